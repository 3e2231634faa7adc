"""End to end as a transformers user sees it: a GPT-OSS-shaped model (4 layers at gpt-oss-20b's attention
dims: hidden 2880, 64 query and 8 kv heads of 64, sinks, a 128-token window every other layer; 4
experts; random weights, bf16) prefills PREFILL tokens, then generates NEW tokens greedily, with
`attn_implementation="kreg"` beside what transformers offers for it ("eager"; "flex_attention"; "sdpa"
refuses sinks); and a Llama-shaped model of the same width beside "sdpa" and "eager". Each row is the
median of REPEATS runs, the GPU drained around each; rel err is the prefill's logits against eager's
(the last position of every row), and for generation the largest per-step logits error over the steps
where eager's greedy token is clear. With `--static`, generation also runs with transformers' static
cache, whose decode steps transformers compiles on a GPU (torch.compile, "reduce-overhead"): rows
"generate-static". Needs transformers (the `transformers` extra); a missing one gives no rows and a note.

    python -m benchmarks.transformers_e2e [--prefill 8192] [--new 128] [--layers 4] [--models gpt-oss,llama]
                                          [--static]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from kreg.benchmarks.common import PROVIDER, Measurement

FAMILY = "transformers"
PREFILL, NEW, LAYERS, REPEATS = 8192, 128, 4, 3
VOCAB = 32000
TOKENS_PER_S = 1e12  # Measurement.rate is work / ms / 1e9: tokens * 1e12 gives tokens per second
_notes: list[str] = []


def gpt_oss(layers: int, device, dtype=torch.bfloat16, **dims):
    from transformers import GptOssConfig, GptOssForCausalLM

    shape = dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
                 head_dim=64, sliding_window=128, num_local_experts=4, num_experts_per_tok=4)
    shape.update(dims)
    alternating = [("sliding_attention", "full_attention")[i % 2] for i in range(layers)]
    config = GptOssConfig(vocab_size=VOCAB, num_hidden_layers=layers, max_position_embeddings=131072,
                          layer_types=alternating, **shape)
    torch.manual_seed(0)
    model = GptOssForCausalLM(config)
    for layer in model.model.layers:  # trained sinks are O(1): random ones of that size
        torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
    return model.to(device=device, dtype=dtype).eval()


def llama(layers: int, device, dtype=torch.bfloat16, **dims):
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
                 head_dim=64)
    shape.update(dims)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, num_hidden_layers=layers, max_position_embeddings=131072, **shape)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def _timed(fn) -> tuple[float, object]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3, result


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def compare(model, impls: list[str], prefill: int, new: int, repeats: int, static: bool = False) -> dict[str, dict]:
    """Per implementation: prefill and generation times (ms, every repeat), the prefill's last logits
    and the logits of every generated step; with `static`, also generation with a static cache
    ("generate-static" and its steps)."""
    ids = torch.randint(0, VOCAB, (1, prefill), generator=torch.Generator().manual_seed(1)).to(model.device)
    out = {}
    for impl in impls:
        # A fresh compile state per implementation (dynamo's caches and CUDA-graph trees are global): one
        # implementation's static-cache graphs, or its failure, never reach the next one's rows.
        torch._dynamo.reset()
        try:
            model.set_attn_implementation(impl)
            with torch.no_grad():
                # Warm up: compiles each kernel specialization a cache length may need (Triton keeps
                # them on disk for later processes) and resolves the tuned configs.
                model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
                prefill_ms, logits = [], None
                for _ in range(repeats):
                    ms, result = _timed(lambda: model(input_ids=ids, logits_to_keep=1).logits)
                    prefill_ms.append(ms)
                    logits = result
                found = {"prefill": prefill_ms, "logits": logits[:, -1]}
                for phase, cache in (("generate", {}), ("generate-static", {"cache_implementation": "static"})):
                    if cache and not static:
                        continue
                    if cache:  # warm up: compiles the static cache's decode steps
                        model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                       pad_token_id=0, **cache)
                    found[phase] = []
                    for _ in range(repeats):
                        ms, result = _timed(lambda cache=cache: model.generate(
                            input_ids=ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                            output_logits=True, return_dict_in_generate=True, pad_token_id=0, **cache))
                        found[phase].append(ms)
                        found[f"{phase} steps"] = result.logits
        except Exception as err:  # noqa: BLE001 - a peer that cannot run this model is reported, not fatal
            _notes.append(f"{type(model).__name__} {impl}: {type(err).__name__}: {str(err)[:200]}")
            continue
        out[impl] = found
    return out


def _step_error(steps: tuple, eager: tuple) -> float:
    """The largest per-step logits error over the steps before eager's greedy choice is first a near tie
    (after it, the two runs may read different prefixes)."""
    worst = 0.0
    for got, want in zip(steps, eager, strict=False):
        worst = max(worst, _rel(got, want))
        top2 = want.float().topk(2, dim=-1).values[0]
        if top2[0] - top2[1] < 2e-2 * want.float().abs().max():
            break
    return worst


def _rows(label: str, shape: str, results: dict, prefill: int, new: int) -> list[Measurement]:
    rows = []
    eager = results.get("eager")
    for impl, found in results.items():
        provider = PROVIDER if impl == "kreg" else impl
        for phase in ("prefill", "generate", "generate-static"):
            if phase not in found:
                continue
            if phase == "prefill":
                tokens, err = prefill, _rel(found["logits"], eager["logits"]) if eager else None
            else:  # each against eager's generation with the same cache
                tokens = new
                want = (eager or {}).get(f"{phase} steps")
                err = None if want is None else _step_error(found[f"{phase} steps"], want)
            ms = sorted(found[phase])
            q = (ms[0], statistics.median(ms), ms[-1])
            rows.append(Measurement(f"{label} {phase}", shape, provider, q, tokens * TOKENS_PER_S, "tokens/s", err))
    return rows


def run(prefill: int = PREFILL, new: int = NEW, layers: int = LAYERS, repeats: int = REPEATS,
        models: tuple[str, ...] = ("gpt-oss", "llama"), static: bool = False) -> list[Measurement]:
    _notes.clear()
    try:
        import transformers

        import kreg.integrations.transformers  # noqa: F401 - registers "kreg"
    except ImportError as err:
        _notes.append(f"transformers e2e: not run ({err}); install the transformers extra")
        return []
    _notes.append(f"transformers {transformers.__version__}")
    shape = f"{layers} layers, prefill {prefill}, +{new} greedy"
    out = []
    peers = {"gpt-oss": (gpt_oss, ["kreg", "eager", "flex_attention"]), "llama": (llama, ["kreg", "sdpa", "eager"])}
    for name in models:
        build, impls = peers[name]
        model = build(layers, "cuda")
        out += _rows(f"{name} e2e", shape, compare(model, impls, prefill, new, repeats, static), prefill, new)
        del model
    return out


def notes() -> list[str]:
    return list(_notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.transformers_e2e")
    parser.add_argument("--prefill", type=int, default=PREFILL)
    parser.add_argument("--new", type=int, default=NEW)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--models", default="gpt-oss,llama", help="comma-separated: gpt-oss, llama")
    parser.add_argument("--static", action="store_true", help="also generate with a static cache (compiled)")
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.transformers_e2e times GPU runs: no GPU here", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, bf16")
    print("| model | phase | impl | median ms | tokens/s | rel err vs eager |")
    print("| --- | --- | --- | --- | --- | --- |")
    for m in run(opts.prefill, opts.new, opts.layers, opts.repeats, tuple(opts.models.split(",")), opts.static):
        err = "-" if m.rel_err is None else f"{m.rel_err:.2e}"
        model, _, phase = m.op.rpartition(" ")
        print(f"| {model} | {phase} | {m.provider} | {m.median_ms:.1f} | {m.rate():.0f} | {err} |")
    for line in notes():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
