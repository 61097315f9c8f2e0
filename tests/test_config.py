import os
import socket
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
    low = load_settings(ROOT / "configs" / "loopback-lowlatency.yaml", environ={})
    assert (low.rtc.send_frame_ms, low.rtc.receive_ptime_ms, low.engine.echo.loopback_window_ms) == (10, 10, 10)
    assert (low.rtc.opus_application, low.rtc.passthrough_pacing) == ("lowdelay", "steady")


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


def test_profile_then_environment_then_flags(tmp_path):
    profile = tmp_path / "p.yaml"
    profile.write_text("server:\n  host: 0.0.0.0\n  port: 7000\nsession:\n  max_sessions: 3\n")
    from_file = load_settings(profile, environ={})
    assert (from_file.server.host, from_file.server.port, from_file.session.max_sessions) == ("0.0.0.0", 7000, 3)
    env = {"LYCHEE_RTC_SERVER__PORT": "7001"}
    from_env = load_settings(profile, environ=env)
    assert (from_env.server.host, from_env.server.port) == ("0.0.0.0", 7001)
    from_flag = load_settings(profile, environ=env, overrides={"server": {"port": 7002}})
    assert (from_flag.server.host, from_flag.server.port) == ("0.0.0.0", 7002)


def test_an_error_names_where_the_bad_value_came_from(tmp_path):
    profile = tmp_path / "p.yaml"
    profile.write_text("session:\n  max_sessions: 0\n")
    with pytest.raises(ConfigError) as from_file:
        load_settings(profile, environ={})
    assert "session.max_sessions" in str(from_file.value) and str(profile) in str(from_file.value)
    with pytest.raises(ConfigError) as from_env:
        load_settings(environ={"LYCHEE_RTC_SERVER__PORT": "eighty"})
    assert "environment variable LYCHEE_RTC_SERVER__PORT" in str(from_env.value)
    assert "echo.yaml" not in str(from_env.value)
    with pytest.raises(ConfigError) as from_flag:
        load_settings(environ={}, overrides={"server": {"port": 70000}})
    assert "server.port" in str(from_flag.value) and "command line" in str(from_flag.value)


def test_a_shipped_profile_is_found_by_name():
    assert load_settings("loopback", environ={}).engine.echo.mode == "loopback"
    assert load_settings("lychee-c4.yaml", environ={}).engine.name == "lychee"
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings("no-such-profile", environ={})


def _run_cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lychee_rtc.cli", *args], capture_output=True, text=True,
                          timeout=120, **kwargs)


def test_the_cli_imports_no_heavy_module_to_parse_or_print_config():
    # What makes --help and `config` slow (or impossible without the model extra) must stay out.
    probe = (
        "import sys\n"
        "from lychee_rtc.cli import build_parser, main\n"
        "build_parser().parse_known_args(['config'])\n"
        "main(['config'])\n"
        "heavy = sorted(m for m in ('torch', 'torchaudio', 'safetensors', 'tqdm', 'aiortc', 'av', 'onnxruntime')"
        " if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert '"engine"' in proc.stdout


def test_unknown_options_are_refused_but_bench_and_tiny_options_pass_through():
    bad = _run_cli("config", "--bogus")
    assert bad.returncode == 2 and "unrecognized arguments: --bogus" in bad.stderr
    bench = _run_cli("bench", "latency", "--help")
    assert bench.returncode == 0 and "--probes" in bench.stdout
    tiny = _run_cli("tiny-checkpoint", "--help")
    assert tiny.returncode == 0 and "--decision-bias" in tiny.stdout


def test_a_busy_port_is_one_line_and_exit_status_2():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = _run_cli("serve", "--port", str(port), env={**os.environ, "LYCHEE_RTC_CONFIG": ""})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_an_invalid_environment_variable_is_one_line_naming_it():
    proc = _run_cli("serve", env={**os.environ, "LYCHEE_RTC_SERVER__PORT": "eighty"})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "LYCHEE_RTC_SERVER__PORT" in lines[0] and "server.port" in lines[0]
