import subprocess
import sys
from pathlib import Path

import pytest

from lychee_rtc.config import ConfigError, load_settings

ROOT = Path(__file__).resolve().parents[1]


def test_default_profile_is_echo_and_loopback_profile_loads():
    settings = load_settings(environ={})
    assert settings.engine.name == "echo" and settings.engine.echo.mode == "echo"
    assert settings.rtc.ice_servers == []
    loopback = load_settings(ROOT / "configs" / "loopback.yaml", environ={})
    assert loopback.engine.echo.mode == "loopback"


def test_environment_then_overrides_take_precedence():
    env = {"LYCHEE_RTC_SERVER__PORT": "9001", "LYCHEE_RTC_SESSION__MAX_SESSIONS": "2",
           "LYCHEE_RTC_RTC__CODECS": "[PCMU]"}
    settings = load_settings(environ=env, overrides={"server": {"port": 9002}})
    assert settings.server.port == 9002
    assert settings.session.max_sessions == 2
    assert settings.rtc.codecs == ["PCMU"]


@pytest.mark.parametrize("env, key", [
    ({"LYCHEE_RTC_SERVER__PORT": "eighty"}, "server.port"),
    ({"LYCHEE_RTC_SESSION__MAX_SESSIONS": "0"}, "session.max_sessions"),
    ({"LYCHEE_RTC_ENGINE__NAME": "gpt"}, "engine.name"),
    ({"LYCHEE_RTC_SERVER__COLOUR": "red"}, "server.colour"),
    ({"LYCHEE_RTC_RTC__ICE_SERVERS": "[{urls: 'http://x'}]"}, "rtc.ice_servers.0.urls"),
])
def test_invalid_values_name_the_key(env, key):
    with pytest.raises(ConfigError) as info:
        load_settings(environ=env)
    assert key in str(info.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(tmp_path / "missing.yaml", environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("server: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_settings(bad, environ={})
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42")
    with pytest.raises(ConfigError, match="mapping"):
        load_settings(scalar, environ={})


def test_serve_refuses_to_start_on_an_invalid_config(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("session:\n  window_grace_ms: -5\n")
    proc = subprocess.run([sys.executable, "-m", "lychee_rtc.cli", "serve", "--config", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "session.window_grace_ms" in proc.stderr


def test_help_explains_every_command():
    out = subprocess.run([sys.executable, "-m", "lychee_rtc.cli", "--help"], capture_output=True, text=True).stdout
    for command in ("serve", "config", "bench", "tiny-checkpoint"):
        assert command in out


def test_bench_help_lists_every_benchmark():
    out = subprocess.run([sys.executable, "-m", "lychee_rtc.cli", "bench", "--help"],
                         capture_output=True, text=True).stdout
    for bench in ("latency", "load", "lychee-step", "vocoder"):
        assert bench in out
