"""``lychee-rtc download`` against a Hub-compatible server the tests start (``tests/hub_server.py``).

The real Hub cannot be reached here, so the boundary is replaced: a loopback server speaking the
Hub's HTTP API (repository info, tree, resolve with HEAD and Range GETs, the CDN redirect for large
files, the Hub's error headers) serves tiny checkpoints in the released layout, next to files
outside the include patterns. Everything on this side is real: the command line in a subprocess,
``huggingface_hub`` with ``HF_ENDPOINT`` / ``HF_HOME`` / ``HF_TOKEN`` / ``HF_HUB_OFFLINE`` as a
user sets them, the inventory check, and finally ``lychee-rtc serve --config lychee-c1`` finding
the download in the cache and answering a WebRTC call with vocoded speech.

The tiny checkpoint has the real vocabulary (158,363 ids) so that its shards are larger than
``huggingface_hub``'s 10 MB read chunk: a cut is resumed from the last chunk the client received,
which a file smaller than one chunk would never show.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hub_server import FakeHub, running
from lychee_rtc.engine.lychee.hub import RELEASED_MODEL, HubFolder, HubReferenceError, download_command, resolve_folder
from lychee_rtc.engine.lychee.random_checkpoint import write_model, write_vocoder
from lychee_rtc.engine.lychee.tiny import TinySpec

ROOT = Path(__file__).resolve().parents[1]
MODEL_REPO, VOCODER_REPO = "HIT-TMG/Lychee-FD", "stepfun-ai/Step-Audio-2-mini"
CHUNK = 10 * 1024 * 1024  # huggingface_hub's read chunk
CUT_FILE = "lychee_full_duplex/model-00002-of-00003.safetensors"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny checkpoint in the released layout, as the two repositories hold it."""
    root = tmp_path_factory.mktemp("hub-source")
    spec = TinySpec(vocab_layout="released", decision_bias=4.0, shards=3)
    write_model(root / "lychee_full_duplex", spec=spec, seed=5, dtype=torch.bfloat16, device=torch.device("cpu"),
                progress=False)
    write_vocoder(root / "token2wav", "tiny", seed=5)
    return root


def make_hub(source: Path, **kwargs) -> FakeHub:
    hub = FakeHub(**kwargs)
    hub.add_folder(MODEL_REPO, source / "lychee_full_duplex", "lychee_full_duplex")
    # Files outside the include patterns: a model card, another version's folder, other weights.
    hub.add_file(MODEL_REPO, "README.md", b"# Lychee-FD\n")
    hub.add_file(MODEL_REPO, "lychee_full_duplex_v0/config.json", b"{}")
    hub.add_file(MODEL_REPO, "other/weights.safetensors", os.urandom(64 * 1024))
    hub.add_folder(VOCODER_REPO, source / "token2wav", "token2wav")
    hub.add_file(VOCODER_REPO, "model-00001-of-00002.safetensors", os.urandom(64 * 1024))
    hub.add_file(VOCODER_REPO, "config.json", b"{}")
    return hub


def download(hub: FakeHub, home: Path, *args: str, env: dict[str, str] | None = None,
             timeout: float = 240) -> subprocess.CompletedProcess:
    """The real command line, as a user runs it (HF_ENDPOINT pointing at the test server)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    environ |= {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(home), "PYTHONPATH": str(ROOT),
                "HF_HUB_DISABLE_TELEMETRY": "1"} | (env or {})
    return subprocess.run([sys.executable, "-m", "lychee_rtc.cli", "download", *args], env=environ,
                          capture_output=True, text=True, timeout=timeout)


def snapshot(home: Path, repo: str) -> Path:
    snaps = list((home / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots").iterdir())
    assert len(snaps) == 1, snaps
    return snaps[0]


def same_files(folder: Path, source: Path) -> None:
    names = sorted(p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file())
    got = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert got == names
    for name in names:
        assert (folder / name).read_bytes() == (source / name).read_bytes(), name


# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def downloaded(source, tmp_path_factory):
    """One download into a fresh cache, with the connection dropped in the middle of a shard."""
    home = tmp_path_factory.mktemp("hf-home")
    hub = make_hub(source)
    hub.cut[CUT_FILE] = CHUNK + CHUNK // 2  # dropped after 15 MB of a 33 MB shard
    assert len(hub.repos[MODEL_REPO].files[CUT_FILE].data) > 2 * CHUNK
    with running(hub):
        result = download(hub, home, "--layout", "any")
    return hub, home, result


@pytest.mark.timeout(400)
def test_download_fetches_the_included_files_byte_for_byte(downloaded, source):
    hub, home, result = downloaded
    assert result.returncode == 0, result.stderr
    same_files(snapshot(home, MODEL_REPO) / "lychee_full_duplex", source / "lychee_full_duplex")
    same_files(snapshot(home, VOCODER_REPO) / "token2wav", source / "token2wav")
    # Nothing outside the include patterns was fetched or listed in the snapshot.
    fetched = {e.path for e in hub.log if "/resolve/" in e.path}
    assert not [p for p in fetched if "README" in p or "_v0/" in p or "other/" in p or p.endswith("/config.json")
                and "lychee_full_duplex/" not in p]
    assert not (snapshot(home, MODEL_REPO) / "README.md").exists()
    assert not (snapshot(home, VOCODER_REPO) / "config.json").exists()
    # The inventory check ran and says what it found.
    assert "model:" in result.stdout and "tensors (BF16)" in result.stdout
    assert "token2wav:" in result.stdout and "hift.pt 328 tensors" in result.stdout


@pytest.mark.timeout(400)
def test_a_cut_download_resumes_where_it_stopped(downloaded):
    hub, _home, result = downloaded
    sha = hub.repos[MODEL_REPO].files[CUT_FILE].sha256
    gets = [e for e in hub.log if e.method == "GET" and e.path == f"/cdn/{sha}"]
    assert [e.range is None for e in gets] == [True, False], gets
    resumed_at = int(gets[1].range.removeprefix("bytes=").rstrip("-"))
    # From the last whole chunk the client had when the connection dropped, not from the start.
    assert resumed_at == CHUNK, gets[1].range
    assert "Trying to resume download" in result.stderr


@pytest.mark.timeout(300)
def test_offline_mode_uses_the_cache(downloaded, tmp_path):
    hub, home, _ = downloaded
    # The server is gone: only the cache can answer.
    result = download(hub, home, "--layout", "any", env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    assert "checking" in result.stderr and "tensors (BF16)" in result.stdout
    # An empty cache offline: a clear refusal, not a traceback.
    empty = download(hub, tmp_path / "empty", "--layout", "any", "--offline")
    assert empty.returncode == 1
    assert "is not complete in the cache" in empty.stderr and "offline mode is on" in empty.stderr
    assert "Traceback" not in empty.stderr


@pytest.mark.timeout(300)
def test_the_released_layout_is_required_unless_told(downloaded):
    hub, home, _ = downloaded
    result = download(hub, home, "--offline")
    assert result.returncode == 1
    assert "is not the released layout (28/4/4/4 layers, hidden 3584, vocab 158363" in result.stderr
    assert "982 tensors" in result.stderr


@pytest.mark.timeout(400)
@pytest.mark.parametrize("into", ["cache", "dir"])
def test_a_killed_download_fetches_only_what_is_missing(source, tmp_path, into):
    home, target = tmp_path / "hf", tmp_path / "models"
    where = ["--dir", str(target)] if into == "dir" else []

    def arrived(path: str) -> bool:
        if into == "dir":
            return (target / path).exists()
        snaps = home / "hub" / "models--HIT-TMG--Lychee-FD" / "snapshots"
        return snaps.is_dir() and any((s / path).exists() for s in snaps.iterdir())

    def partials() -> list[Path]:
        root = target / ".cache" if into == "dir" else home / "hub" / "models--HIT-TMG--Lychee-FD" / "blobs"
        return [p for p in root.rglob("*.incomplete")] if root.exists() else []

    hub = make_hub(source)
    stalled_file = "lychee_full_duplex/model-00001-of-00003.safetensors"
    hub.stall[stalled_file] = CHUNK + 1024 * 1024
    with running(hub):
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
        environ |= {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(home), "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen([sys.executable, "-m", "lychee_rtc.cli", "download", "--only", "model",
                                 "--layout", "any", *where], env=environ, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        try:
            others = [p for p in hub.repos[MODEL_REPO].files if p.startswith("lychee_full_duplex/")
                      and p != stalled_file]
            deadline = time.monotonic() + 180
            while not (hub.stalled.is_set() and all(arrived(p) for p in others) and partials()):
                assert proc.poll() is None, proc.stderr.read().decode()
                if time.monotonic() > deadline:
                    pytest.fail("the first download never reached its stalled file with the others done")
                time.sleep(0.1)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            proc.stderr.close()
        first_run = len(hub.log)
        hub.stall.clear()
        result = download(hub, home, "--only", "model", "--layout", "any", *where)
    assert result.returncode == 0, result.stderr
    rerun = hub.log[first_run:]
    contents = [e.path for e in rerun if e.method == "GET" and (e.path.startswith("/cdn/") or "/resolve/" in e.path)]
    sha = hub.repos[MODEL_REPO].files[stalled_file].sha256
    assert contents == [f"/cdn/{sha}"], contents  # the missing file, and nothing that was already there
    assert not [e for e in rerun if "/resolve/" in e.path and not e.path.endswith(stalled_file)]
    assert "of partial files an interrupted download left" in result.stderr
    assert not partials()
    folder = target / "lychee_full_duplex" if into == "dir" else snapshot(home, MODEL_REPO) / "lychee_full_duplex"
    same_files(folder, source / "lychee_full_duplex")


@pytest.mark.timeout(400)
def test_a_gated_repository_needs_hf_token(source, tmp_path):
    hub = make_hub(source)
    hub.repos[MODEL_REPO].gated = True
    with running(hub):
        refused = download(hub, tmp_path / "a", "--only", "model", "--layout", "any")
        wrong = download(hub, tmp_path / "b", "--only", "model", "--layout", "any", env={"HF_TOKEN": "hf_wrong"})
        first = len(hub.log)
        allowed = download(hub, tmp_path / "c", "--only", "model", "--layout", "any", "--dir", str(tmp_path / "dir"),
                           env={"HF_TOKEN": hub.token})
    assert refused.returncode == 1
    assert "HIT-TMG/Lychee-FD is gated" in refused.stderr and "401" in refused.stderr
    assert "set HF_TOKEN" in refused.stderr and "Traceback" not in refused.stderr
    assert wrong.returncode == 1
    assert "refused access to HIT-TMG/Lychee-FD (401: Invalid credentials" in wrong.stderr
    assert "the token in HF_TOKEN was refused" in wrong.stderr
    assert allowed.returncode == 0, allowed.stderr
    hub_calls = [e for e in hub.log[first:] if not e.path.startswith("/cdn/")]
    assert hub_calls and all(e.token for e in hub_calls)
    # The signed CDN address never gets the token (it leaves the Hub's host).
    assert not [e for e in hub.log[first:] if e.path.startswith("/cdn/") and e.token]
    same_files(tmp_path / "dir" / "lychee_full_duplex", source / "lychee_full_duplex")
    assert f"engine.lychee.model_root: {tmp_path / 'dir' / 'lychee_full_duplex'}" in allowed.stdout


@pytest.mark.timeout(300)
def test_missing_files_and_folders_are_named(source, tmp_path):
    hub = make_hub(source)
    hub.missing.add("lychee_full_duplex/vocab.json")
    with running(hub):
        listed = download(hub, tmp_path / "a", "--only", "model", "--layout", "any")
        folder = download(hub, tmp_path / "b", "--only", "token2wav", "--token2wav", f"hf://{VOCODER_REPO}/nope")
        hub.missing.clear()
        del hub.repos[MODEL_REPO].files["lychee_full_duplex/model-00003-of-00003.safetensors"]
        shard = download(hub, tmp_path / "c", "--only", "model", "--layout", "any")
        no_repo = download(hub, tmp_path / "d", "--only", "model", "--model", "hf://HIT-TMG/Nothing/here")
    assert listed.returncode == 1
    assert "lychee_full_duplex/vocab.json" in listed.stderr and "404" in listed.stderr
    assert folder.returncode == 1 and "has no file matching nope/*" in folder.stderr
    assert shard.returncode == 1
    assert "shard model-00003-of-00003.safetensors named in model.safetensors.index.json does not exist" \
        in shard.stderr
    assert no_repo.returncode == 1 and "HIT-TMG/Nothing does not exist" in no_repo.stderr
    for r in (listed, folder, shard, no_repo):
        assert "Traceback" not in r.stderr


def test_references_and_the_command_they_need(tmp_path, monkeypatch):
    ref = HubFolder.parse("hf://HIT-TMG/Lychee-FD@v1/lychee_full_duplex")
    assert (ref.repo_id, ref.revision, ref.folder, ref.include) == ("HIT-TMG/Lychee-FD", "v1", "lychee_full_duplex",
                                                                   ["lychee_full_duplex/*"])
    assert str(ref) == "hf://HIT-TMG/Lychee-FD@v1/lychee_full_duplex"
    for bad in ("hf://nope", "hf://a/b/../../etc", "/models/x"):
        with pytest.raises(HubReferenceError):
            HubFolder.parse(bad)
    assert download_command(model=RELEASED_MODEL) == "lychee-rtc download"
    assert download_command(model=ref) == "lychee-rtc download --model hf://HIT-TMG/Lychee-FD@v1/lychee_full_duplex " \
                                          "--only model"
    assert resolve_folder("/some/folder", "k", "model") == Path("/some/folder")


@pytest.mark.timeout(400)
async def test_serve_finds_the_download_in_the_cache(downloaded, tmp_path):
    """``lychee-rtc serve --config lychee-c1`` as shipped (hf:// folders, the built-in voice), only the
    device moved to the CPU: it loads the downloaded checkpoint from the cache, offline, and speaks."""
    from lychee_rtc.bench.client import RATE, RtcClient
    from lychee_rtc.bench.server_process import spawned_server

    _hub, home, result = downloaded
    assert result.returncode == 0, result.stderr
    env = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "LYCHEE_RTC_SERVER__HOST": "127.0.0.1",
           "LYCHEE_RTC_ENGINE__LYCHEE__DEVICE": "cpu", "LYCHEE_RTC_ENGINE__LYCHEE__DTYPE": "fp32",
           "LYCHEE_RTC_ENGINE__LYCHEE__MAX_SEQ": "1024", "LYCHEE_RTC_ENGINE__LYCHEE__TORCH_THREADS": "1",
           "LYCHEE_RTC_ENGINE__LYCHEE__TOKEN2WAV__DEVICE": "cpu", "PYTHONPATH": str(ROOT)}
    async with spawned_server(str(ROOT / "configs" / "lychee-c1.yaml"), env=env, ready_timeout_s=240) as (url, _):
        client = RtcClient(url)
        await client.connect()
        try:
            await client.wait_event("session.created", timeout=60)
            client.mic.feed((0.05 * np.random.default_rng(0).standard_normal(RATE * 30)).astype(np.float32))
            client.send({"type": "input_audio_buffer.commit"})
            started = await client.wait_event("response.created", timeout=120)
            playing = await client.wait_event("output_audio_buffer.started", timeout=120,
                                              response_id=started["response_id"])
            start = playing["sample_offset"] * RATE // playing["sample_rate"]
            await client.wait_audio(start + RATE // 4, timeout=120)
            heard = client.received.signal(start, start + RATE // 4)
            assert float(np.sqrt(np.mean(heard ** 2))) > 1e-3, "vocoded speech expected"
        finally:
            await client.close()


def test_serve_without_the_download_says_what_to_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env |= {"HF_HOME": str(tmp_path / "nothing"), "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "lychee_rtc.cli", "serve", "--config", "lychee-c1"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "engine.lychee.model_root: hf://HIT-TMG/Lychee-FD/lychee_full_duplex is not in the Hugging Face cache" \
        in result.stderr
    assert "`lychee-rtc download`" in result.stderr
