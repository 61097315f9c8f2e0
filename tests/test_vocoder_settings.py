"""The vocoder settings section and the pool built from it (as the tiny-checkpoint writes it)."""

import pytest

from lychee_rtc.engine.base import SessionOptions
from lychee_rtc.engine.lychee.token2wav_settings import Token2WavSettings, VocoderSettingsError, build_token2wav_pool
from lychee_rtc.vocoder.token2wav.tiny import write_tiny_vocoder


@pytest.fixture(scope="module")
def section(tmp_path_factory):
    return write_tiny_vocoder(tmp_path_factory.mktemp("tiny"), seed=2)


def test_tiny_section_builds_a_pool(section):
    pool = build_token2wav_pool(section)
    assert pool.voice_names == ("default",)
    v = pool(0, SessionOptions())
    assert [a.size for a in v.push("r", list(range(14)), False)] == [5760]


@pytest.mark.parametrize("edit,key", [
    (lambda d: d.pop("folder"), "token2wav.folder"),
    (lambda d: d.__setitem__("voices", {"x": "/nope.wav"}), "token2wav.voices.x"),
    (lambda d: d.__setitem__("default_voice", "zz"), "token2wav.default_voice"),
    (lambda d: d.__setitem__("dtype", "int8"), "token2wav.dtype"),
    (lambda d: d.__setitem__("hop", 3), "token2wav.hop"),
    (lambda d: d.__setitem__("colour", 1), "token2wav.colour"),
    (lambda d: d.__setitem__("long_stream", "wrap"), "token2wav.long_stream"),
])
def test_errors_name_the_key(section, edit, key):
    data = {**section, "voices": dict(section["voices"])}
    edit(data)
    with pytest.raises(VocoderSettingsError, match=key.replace(".", r"\.")):
        Token2WavSettings.from_mapping(data, prefix="token2wav")
