"""Write a tiny random Lychee-FD checkpoint in the released layout.

Same files and names as the real one (``config.json`` with nested decoder configs and every
``*_token_id``, ``generation_config.json``, sharded ``model-0000i-of-0000N.safetensors`` with
``model.safetensors.index.json`` including the three unused side embedding tables, and a Qwen2-style
``vocab.json`` / ``merges.txt`` / ``tokenizer_config.json``), only small: a byte-level vocabulary
of a few hundred ids laid out like the real one (text, base specials, a codec block, the 11 duplex
tokens at the end). It loads through exactly the same loader, so tests and CPU runs exercise the
real code path.

``lychee-rtc tiny-checkpoint OUT`` calls :func:`main`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import save_file

from .config import parse_config
from .model import LycheeFD, checkpoint_targets, ignored_tensors
from .tokenizer import bytes_to_unicode

# Order in which the training code adds the duplex tokens (they get consecutive ids).
DUPLEX_TOKENS = ("<|S-S|>", "<|S-L|>", "<|K-L|>", "<|K-S|>", "<|Detect|>", "<|Sleep|>", "<|TextPad|>",
                 "<|StokenPad|>", "<|AudioPad|>", "<|StokenDelay|>", "<|BackChannel|>")
BASE_SPECIALS = ("<|endoftext|>", "<|BOT|>", "<|EOT|>", "<audio_patch>", "<tts_start>", "<tts_end>", "<tts_pad>")


@dataclass(frozen=True)
class TinySpec:
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    main_layers: int = 4
    branch_layers: int = 2  # stoken, control and merge stacks
    control_branch_layer: int = 2  # from the top -> control taps the residual after main layer 2
    codec_size: int = 64
    audio_state: int = 32
    audio_heads: int = 2
    audio_layers: int = 2
    audio_ctx: int = 64
    max_positions: int = 4096
    stoken_delay_num: int = 10
    shards: int = 3
    # "compact": a few hundred ids. "released": the real vocabulary size and the real special-token
    # ids (158363 ids; needed by code that hard-codes ids, e.g. the reference's 151690 audio patch).
    vocab_layout: str = "compact"
    # > 0: bias the random control head towards "keep" decisions (K-L while listening, K-S while
    # speaking), so the tiny model only starts speaking when asked (input_audio_buffer.commit) and
    # then talks until <tts_end> instead of stopping at a random barge-in decision. 0: pure noise.
    decision_bias: float = 0.0
    # True (with decision_bias): the speech channel never samples <tts_end>, so a response talks
    # until it is interrupted (or max_speech_tokens forces the end); for tests of the cancel path.
    endless_speech: bool = False


# Released ids (lychee_fd.md 1.7 / token2wav.md E.1); <|BOT|> is placed next to <|EOT|>.
RELEASED_IDS = {"<|endoftext|>": 151643, "<|BOT|>": 151664, "<|EOT|>": 151665, "<audio_patch>": 151690,
                "<tts_start>": 151693, "<tts_end>": 151694, "<tts_pad>": 151695}
RELEASED_AUDIO_MIN, RELEASED_AUDIO_BLOCK, RELEASED_CODEC = 151696, 6656, 6561


def tiny_vocab(spec: TinySpec) -> tuple[dict[str, int], dict[str, int]]:
    """Byte tokens (0..255), base specials, <audio_0..N-1>, then the duplex tokens."""
    byte_tokens = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    added: dict[str, int] = {}
    if spec.vocab_layout == "released":
        added.update(RELEASED_IDS)
        for c in range(RELEASED_AUDIO_BLOCK):
            added[f"<audio_{c}>"] = RELEASED_AUDIO_MIN + c
        for i, tok in enumerate(DUPLEX_TOKENS):
            added[tok] = RELEASED_AUDIO_MIN + RELEASED_AUDIO_BLOCK + i
        return byte_tokens, added
    nxt = len(byte_tokens)
    for tok in BASE_SPECIALS:
        added[tok] = nxt
        nxt += 1
    for c in range(spec.codec_size):
        added[f"<audio_{c}>"] = nxt
        nxt += 1
    for tok in DUPLEX_TOKENS:
        added[tok] = nxt
        nxt += 1
    return byte_tokens, added


def tiny_config(spec: TinySpec) -> dict:
    _, added = tiny_vocab(spec)
    vocab = max(added.values()) + 1

    def decoder(layers: int) -> dict:
        return {
            "vocab_size": vocab, "hidden_size": spec.hidden, "intermediate_size": spec.intermediate,
            "num_hidden_layers": layers, "num_attention_heads": spec.heads,
            "num_key_value_heads": spec.kv_heads, "num_attention_groups": spec.kv_heads,
            "hidden_act": "silu", "max_position_embeddings": spec.max_positions,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
        }

    text = decoder(spec.main_layers)
    # The released text_config is compact: drop what equals the layer configs' defaults.
    for key in ("rms_norm_eps", "hidden_act"):
        text.pop(key)
    a = added
    return {
        "model_type": "step_audio_2_full_duplex",
        "architectures": ["StepAudio2FullDuplex"],
        "torch_dtype": "float32",
        "text_config": text,
        "stoken_layer_config": decoder(spec.branch_layers),
        "control_layer_config": decoder(spec.branch_layers),
        "merge_layer_config": decoder(spec.branch_layers),
        "control_branch_layer": spec.control_branch_layer,
        "audio_encoder_config": {
            "model_type": "step_audio_2_encoder", "n_mels": 128, "n_audio_ctx": spec.audio_ctx,
            "n_audio_state": spec.audio_state, "n_audio_head": spec.audio_heads,
            "n_audio_layer": spec.audio_layers, "llm_dim": spec.hidden, "kernel_size": 3,
            "adapter_stride": 2,
        },
        "control_token_chunk_size": 10,
        "stoken_delay_num": spec.stoken_delay_num,
        "adding_text_hiddenstates": False,
        "stoken_token_ids_min": a["<tts_end>"],
        "stoken_token_ids_max": a["<|S-S|>"],
        "control_token_ids_min": a["<|S-S|>"],
        "control_token_ids_max": a["<|Detect|>"],
        "start_speaking_token_id": a["<|S-S|>"],
        "start_listening_token_id": a["<|S-L|>"],
        "keep_listening_token_id": a["<|K-L|>"],
        "keep_speaking_token_id": a["<|K-S|>"],
        "detect_token_id": a["<|Detect|>"],
        "sleep_token_id": a["<|Sleep|>"],
        "text_pad_token_id": a["<|TextPad|>"],
        "text_sleep_token_id": None,
        "stoken_pad_token_id": a["<|StokenPad|>"],
        "audio_pad_token_id": a["<|AudioPad|>"],
        "stoken_delay_token_id": a["<|StokenDelay|>"],
        "start_bc_token_id": a["<|BackChannel|>"],
        "keep_bc_token_id": a["<|BackChannel|>"],
        "end_bc_token_id": a["<|S-L|>"],
        "audio_patch_token_id": a["<audio_patch>"],
        "tts_start_token_id": a["<tts_start>"],
        "tts_end_token_id": a["<tts_end>"],
        "tts_pad_token_id": a["<tts_pad>"],
        "stoken_audio_token_id_min": a["<audio_0>"],
        "stoken_codec_vocab_size": RELEASED_CODEC if spec.vocab_layout == "released" else spec.codec_size,
        "no_text_label": False,
        "no_stoken_label": False,
        "use_sliding_window": False,
        "sliding_window": 2048,
    }


def random_tensor(name: str, shape: tuple[int, ...], g: torch.Generator, device: torch.device | str = "cpu",
                  full_shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A random value for one checkpoint tensor: norms near 1, weights ~ N(0, 1/fan_in).

    ``full_shape``: the whole tensor's shape when ``shape`` is a block of its rows (the scale
    depends on the whole tensor's fan-in).
    """
    def randn() -> torch.Tensor:
        return torch.randn(shape, generator=g, device=device)

    if name.endswith("norm.weight") or name.endswith("layernorm.weight") or name.endswith("_ln.weight"):
        return 1.0 + 0.1 * randn()
    if name.endswith(".bias"):
        return 0.02 * randn()
    if "embed_tokens" in name or "positional_embedding" in name:
        return 0.5 * randn()
    whole = full_shape or shape
    fan_in = whole[1] * (whole[2] if len(whole) > 2 else 1) if len(whole) > 1 else whole[0]
    return randn() / fan_in ** 0.5


def random_state(model: LycheeFD, seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint-named random tensors, side tables included."""
    g = torch.Generator().manual_seed(seed)
    state = {name: random_tensor(name, tuple(t.shape), g).contiguous()
             for name, t in checkpoint_targets(model).items()}
    for name, shape in ignored_tensors(model.cfg).items():
        state[name] = (0.5 * torch.randn(shape, generator=g)).contiguous()
    return state


@torch.no_grad()
def randomize_(model: LycheeFD, seed: int = 0) -> None:
    """Fill a materialised model in place (on its device) with the same kind of random weights."""
    device = model.lm_head.weight.device
    g = torch.Generator(device=device).manual_seed(seed)
    for name, t in checkpoint_targets(model).items():
        t.copy_(random_tensor(name, tuple(t.shape), g, device).to(t.dtype))


def bias_decisions(state: dict[str, torch.Tensor], raw: dict, bias: float) -> None:
    """Make residual dimension 0 a constant "bias" feature seen only by the control head.

    Every token embedding carries +1 in dim 0 and no layer writes to it (o_proj/down_proj row 0
    zeroed, adapter output dim 0 zeroed), so the residual there is always positive; only the
    control stack's final norm keeps dim 0, and lm_head column 0 favours K-L / K-S over S-S / S-L.
    """
    for name, t in state.items():
        decision_bias_edit(name, t, 0, raw, bias)


def decision_bias_edit(name: str, rows: torch.Tensor, first_row: int, raw: dict, bias: float) -> None:
    """:func:`bias_decisions` on rows ``first_row..`` of one tensor, in place (a writer that makes a
    checkpoint a block of rows at a time applies it to each block)."""
    if name == "model.embed_tokens.weight":
        rows[:, 0] = 1.0
    elif name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")) or name == "adapter.linear2.weight":
        if first_row == 0:
            rows[0, :] = 0.0
    elif name == "adapter.linear2.bias" or name in ("model.norm.weight", "stoken_model.norm.weight",
                                                    "merge_model.norm.weight"):
        rows[0] = 0.0
    elif name == "control_model.norm.weight":
        rows[0] = 1.0
    elif name == "lm_head.weight":
        rows[:, 0] = 0.0
        for key, sign in (("keep_listening_token_id", 1), ("keep_speaking_token_id", 1),
                          ("start_speaking_token_id", -1), ("start_listening_token_id", -1)):
            i = raw[key] - first_row
            if 0 <= i < rows.shape[0]:
                rows[i, 0] = sign * bias


def silence_speech_end(state: dict[str, torch.Tensor], raw: dict) -> None:
    """Let the merge stack see the constant feature of :func:`bias_decisions` and give <tts_end> a
    large negative weight on it: the speech channel then never picks <tts_end> by itself."""
    state["merge_model.norm.weight"][0] = 1.0
    state["lm_head.weight"][raw["tts_end_token_id"], 0] = -1000.0


def write_tiny_checkpoint(out: str | Path, *, seed: int = 0, spec: TinySpec | None = None,
                          dtype: torch.dtype = torch.float32) -> Path:
    spec = spec or TinySpec()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = tiny_config(spec)
    raw["torch_dtype"] = str(dtype).removeprefix("torch.")
    cfg = parse_config(raw)
    with torch.device("meta"):
        model = LycheeFD(cfg)
    state = random_state(model, seed)
    if spec.decision_bias:
        bias_decisions(state, raw, spec.decision_bias)
    if spec.endless_speech:
        if not spec.decision_bias:
            raise ValueError("endless_speech needs decision_bias (it uses the same constant feature)")
        silence_speech_end(state, raw)
    state = {k: v.to(dtype) for k, v in state.items()}

    names = list(state)
    n = max(1, spec.shards)
    per = -(-len(names) // n)
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(n):
        chunk = names[i * per:(i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: state[k] for k in chunk}, str(out / fname), metadata={"format": "pt"})
        for k in chunk:
            weight_map[k] = fname
            total += state[k].numel() * state[k].element_size()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"_from_model_config": True}, indent=2))

    write_tiny_tokenizer(out, spec)
    return out


def write_tiny_tokenizer(out: Path, spec: TinySpec) -> None:
    """The slow-tokenizer files (``vocab.json``, ``merges.txt``, ``tokenizer_config.json``; no
    ``tokenizer.json``), as a checkpoint saved from the reference's ``use_fast=False`` tokenizer has
    them: byte tokens and no merges, then the added tokens with their ids."""
    byte_tokens, added = tiny_vocab(spec)
    (out / "vocab.json").write_text(json.dumps(byte_tokens, ensure_ascii=False), encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": {str(i): {"content": t, "special": True} for t, i in added.items()},
    }, ensure_ascii=False, indent=2), encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lychee-rtc tiny-checkpoint",
                                     description="Write a tiny random Lychee-FD checkpoint (released layout).")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="output folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--no-vocoder", action="store_true",
                        help="do not also write a tiny Token2Wav (OUT/token2wav, OUT/voices/default.wav)")
    parser.add_argument("--decision-bias", type=float, default=0.0,
                        help="> 0: the model keeps listening until asked to answer (commit) and then "
                             "speaks until <tts_end>; 0 (default): purely random decisions")


def run(args: argparse.Namespace) -> int:
    from .checkpoint import parse_dtype

    spec = TinySpec(decision_bias=args.decision_bias)
    path = write_tiny_checkpoint(args.out, seed=args.seed, spec=spec, dtype=parse_dtype(args.dtype))
    print(f"wrote tiny Lychee-FD checkpoint to {path}")
    lychee = {"model_root": str(path), "device": "cpu", "dtype": "fp32", "torch_threads": 1}
    if not args.no_vocoder:
        from lychee_rtc.vocoder.token2wav.tiny import write_tiny_vocoder

        lychee["token2wav"] = write_tiny_vocoder(path, seed=args.seed)
        print(f"wrote tiny Token2Wav to {lychee['token2wav']['folder']}")
    profile = write_cpu_profile(path, lychee)
    print(f"wrote a CPU serving profile: lychee-rtc serve --config {profile}")
    return 0


def write_cpu_profile(folder: Path, lychee: dict) -> Path:
    """A profile next to the checkpoint that serves it on CPU (one session, model-decided turns)."""
    import yaml

    profile = {
        "session": {"max_sessions": 1, "vad_barge_in": False},
        "engine": {"name": "lychee", "lychee": lychee},
    }
    target = Path(folder) / "lychee-cpu.yaml"
    target.write_text("# Serves this tiny checkpoint on CPU: lychee-rtc serve --config " + str(target) + "\n"
                      + yaml.safe_dump(profile, sort_keys=False))
    return target


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
