"""attn_implementation="kreg" in Hugging Face transformers (kreg.integrations.transformers), on tiny
random-weight models built from transformers' own configs: Llama (causal), Qwen2 (a sliding window on
alternate layers) and GPT-OSS (sinks and alternating windows). Against `attn_implementation="eager"`:
logits of batch 1 and of a left-padded batch of 3, the gradients of one training step, and greedy
generation step by step. Masks kreg cannot express go to eager attention with one warning. On the CPU
the plain backend runs the ops' PyTorch references, and a vendor's kernels run through the interpreter
where a test registers that vendor; on a GPU every call runs the kernels in bf16."""

import logging
import os

import pytest
import torch

from tests.conftest import HAS_GPU

if os.environ.get("KREG_REQUIRE_TRANSFORMERS") == "1":
    import transformers  # noqa: F401 - CI installs the extra: a missing one fails here, never skips
transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import kreg.integrations.transformers as kt  # noqa: E402
from kreg.registry.dispatch import OpHandle  # noqa: E402

DEVICE = torch.device("cuda" if HAS_GPU else "cpu")
DTYPE = torch.bfloat16 if HAS_GPU else torch.float32
# Relative error of logits and gradients against eager in the same dtype.
TOL = 3e-2 if HAS_GPU else 1e-4
WINDOW = 5
VOCAB = 128
MODELS = ("llama", "qwen2", "gpt_oss")


def _model(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    alternating = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=True, max_window_layers=0, **alternating))
    else:
        model = GptOssForCausalLM(GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                               **alternating))
        for layer in model.model.layers:  # random sinks, so that they take a real share of each row
            torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
    return model.to(device=DEVICE, dtype=DTYPE)


def _batch(size: int, length: int = 12, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and a left-padding mask: row i > 0 has 3 * i + 1 padding tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (size, length), generator=gen)
    mask = torch.ones(size, length, dtype=torch.long)
    for row in range(1, size):
        mask[row, : 3 * row + 1] = 0
    return ids.to(DEVICE), mask.to(DEVICE)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.fixture
def calls(monkeypatch) -> list[tuple[str, dict]]:
    """Every kreg op call the integration makes: (op, keyword arguments)."""
    seen: list[tuple[str, dict]] = []
    original = OpHandle.__call__

    def spy(self, *args, **kwargs):
        seen.append((self.op.name, kwargs))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(OpHandle, "__call__", spy)
    return seen


def _fallbacks(caplog) -> list[logging.LogRecord]:
    """The integration's own warnings (each names a call that ran eager attention); others, such as
    torch.compile's graph-break notes under a static cache on a GPU, are not about kreg's choice."""
    return [record for record in caplog.records if record.name == kt.__name__]


def _follows_eager(eager, ours, prompt: int) -> None:
    """Greedy generations compared step by step: each step's logits within tolerance of eager's, and the
    same token wherever eager's top-1/top-2 gap is wider than the tolerance. Random weights give near
    ties: after a step with one, the two runs may read different prefixes, so the comparison stops."""
    for step, (want, got) in enumerate(zip(eager.logits, ours.logits, strict=True)):
        assert _rel(got, want) < TOL, f"step {step}"
        top2 = want.float().topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > TOL * want.float().abs().amax(-1)
        new = prompt + step
        if not torch.equal(ours.sequences[clear, new], eager.sequences[clear, new]):
            pytest.fail(f"step {step}: a token differs where eager's choice is clear")
        if not clear.all():
            break


def _logits(model, impl, ids, mask, **kwargs) -> torch.Tensor:
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **kwargs).logits


@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.parametrize("kind", MODELS)
def test_logits_match_eager(kind, size, calls, caplog):
    model = _model(kind).eval()
    ids, mask = _batch(size)
    want = _logits(model, "eager", ids, mask)
    with caplog.at_level(logging.WARNING, logger=kt.__name__):
        got = _logits(model, "kreg", ids, mask)
    kept = mask.bool()
    assert _rel(got[kept], want[kept]) < TOL
    assert not _fallbacks(caplog), "kreg fell back to eager attention"
    # One call per layer, to the op the model needs, with the model's scale, window and sinks.
    op = "sink_attention" if kind == "gpt_oss" else "flash_attention"
    assert [name for name, _ in calls] == [op, op]
    assert [kwargs["window"] for _, kwargs in calls] == ([None, None] if kind == "llama" else [WINDOW, None])
    assert all(kwargs["sm_scale"] == 16**-0.5 for _, kwargs in calls)
    if kind == "gpt_oss":
        assert all(kwargs["sinks"].dtype == torch.float32 for _, kwargs in calls)
    assert all(("cu_seqlens_q" in kwargs) == (size > 1) for _, kwargs in calls)


def test_a_padded_forward_packs_its_batch_once_per_mask(monkeypatch):
    """The packing of a padded batch (its one host read) is worked out by the mask hook, once per
    forward and mask type, not once per layer."""
    model = _model("llama").eval()
    made = []
    original = kt.Packing.of.__func__

    def counted(cls, mask, s_q):
        made.append(s_q)
        return original(cls, mask, s_q)

    monkeypatch.setattr(kt.Packing, "of", classmethod(counted))
    ids, mask = _batch(3)
    _logits(model, "kreg", ids, mask)
    assert made == [ids.shape[1]] and len(model.model.layers) == 2


@pytest.mark.parametrize("kind", MODELS)
def test_one_training_step_has_eager_gradients(kind):
    ids, mask = _batch(3)
    # A label counts where its token and the one predicting it are both kept: a padded row's output
    # is left to the implementation (eager spreads it over every key, kreg returns zeros).
    predicted_by_kept = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], dim=1)
    labels = ids.masked_fill((mask == 0) | (predicted_by_kept == 0), -100)
    grads = {}
    for impl in ("eager", "kreg"):
        model = _model(kind).train()
        model.set_attn_implementation(impl)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads[impl] = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert grads["kreg"].keys() == grads["eager"].keys()
    if kind == "gpt_oss":
        assert any(name.endswith("sinks") for name in grads["kreg"])
    for name, want in grads["eager"].items():
        if want.norm() > 0:
            assert _rel(grads["kreg"][name], want) < TOL, name


@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.parametrize("kind", MODELS)
def test_generate_follows_eager_step_by_step(kind, size, calls):
    """32 greedy tokens: the logits of every step within tolerance of eager's, and the same token
    wherever eager's top-1/top-2 gap is wider than the tolerance (random weights give near ties)."""
    model = _model(kind).eval()
    ids, mask = _batch(size)
    runs = {}
    for impl in ("eager", "kreg"):
        model.set_attn_implementation(impl)
        runs[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    _follows_eager(runs["eager"], runs["kreg"], ids.shape[1])
    ops = {name for name, _ in calls}
    # Batch 1 decodes one token at a time through `decode`; a padded batch stays packed varlen until a
    # sliding layer's cache has slid past the padding.
    assert "decode" in ops if size == 1 else ("decode" in ops) == (kind != "llama")


@pytest.mark.long
@pytest.mark.parametrize("kind,size", [("llama", 1), ("gpt_oss", 3)])
def test_generate_with_a_static_cache_follows_eager(kind, size, calls, caplog):
    """A static cache holds empty slots past the tokens seen: kreg attends to the tokens only. On a GPU
    transformers compiles a static cache's decode steps (torch.compile): the unpadded batch goes through
    that; the padded one runs eager (compiled, it took 4 minutes on an H200 for no path of kreg's that
    the other two runs miss)."""
    model = _model(kind).eval()
    ids, mask = _batch(size)
    runs = {}
    with caplog.at_level(logging.WARNING, logger=kt.__name__):
        for impl in ("eager", "kreg"):
            model.set_attn_implementation(impl)
            runs[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                        cache_implementation="static", output_logits=True,
                                        return_dict_in_generate=True, pad_token_id=0, disable_compile=size > 1)
    assert not _fallbacks(caplog), "kreg fell back to eager attention"
    if size == 1:  # nothing padded: the keys are cut to the tokens seen, no packing; one token steps decode
        assert "decode" in {name for name, _ in calls}
        assert not any("cu_seqlens_q" in kwargs for _, kwargs in calls)
    _follows_eager(runs["eager"], runs["kreg"], ids.shape[1])


def test_a_mask_kreg_cannot_express_runs_eager_with_one_warning(calls, caplog):
    """GPT-OSS fed a 4-D block-diagonal mask (two documents in one row): eager attention, sinks and
    window included, with one logged warning for any number of calls."""
    model = _model("gpt_oss").eval()
    ids, _ = _batch(1)
    n = ids.shape[1]
    doc = torch.arange(n, device=DEVICE) >= n // 2
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(n, n, dtype=torch.bool, device=DEVICE).tril()
    mask = torch.zeros(1, 1, n, n, dtype=DTYPE, device=DEVICE).masked_fill(~allowed, torch.finfo(DTYPE).min)
    want = _logits(model, "eager", ids, mask)
    with caplog.at_level(logging.WARNING, logger=kt.__name__):
        kt._warned.clear()
        first = _logits(model, "kreg", ids, mask)
        second = _logits(model, "kreg", ids, mask)
    assert torch.equal(first, want) and torch.equal(second, want)
    assert len(_fallbacks(caplog)) == 1 and "cannot express" in _fallbacks(caplog)[0].getMessage()
    assert not calls
    # The same model without the mask's documents is a different answer: the mask was applied.
    assert _rel(_logits(model, "kreg", ids, None)[:, n // 2 :], want[:, n // 2 :]) > TOL


def test_the_mask_hook_hands_eager_masks_for_what_kreg_cannot_express():
    """Overlays (packed sequences, image tokens: and/or-combined mask functions), vmap-built masks and
    a cache whose keys are not exactly the tokens seen (a static cache without a padding mask) get
    eager's 4-D additive mask, which the attention then runs eagerly; the masks kreg expresses get
    None or a 2-D padding mask."""
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_causal_mask_function

    def mask(function, attention_mask=None, q_offset=0, kv_length=6, kv_offset=0, **kwargs):
        return kt.kreg_mask(batch_size=2, q_length=2, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
                            mask_function=function, attention_mask=attention_mask, dtype=torch.float32, **kwargs)

    padded = torch.ones(2, 6, dtype=torch.bool)
    padded[1, :2] = False
    assert mask(causal_mask_function, q_offset=4) is None
    assert mask(sliding_window_causal_mask_function(3), q_offset=4) is None
    assert torch.equal(mask(sliding_window_causal_mask_function(3), padded, q_offset=4), padded)
    assert mask(causal_mask_function, torch.ones(2, 6, dtype=torch.bool), q_offset=4) is None
    overlay = and_masks(causal_mask_function, lambda b, h, q, kv: kv != 1)
    # A static cache (more slots than tokens, the offset maybe a tensor): a mask over the tokens seen.
    assert torch.equal(mask(causal_mask_function, q_offset=2), torch.ones(2, 4, dtype=torch.bool))
    assert torch.equal(mask(causal_mask_function, q_offset=torch.tensor(2)), torch.ones(2, 4, dtype=torch.bool))
    for eager_only in (mask(overlay, q_offset=4), mask(causal_mask_function, q_offset=4, use_vmap=True),
                       mask(causal_mask_function, q_offset=2, kv_offset=1, kv_length=5)):
        assert eager_only.shape[:3] == (2, 1, 2) and eager_only.dtype == torch.float32
    assert mask(overlay, q_offset=4)[0, 0, 1, 1] == torch.finfo(torch.float32).min


@pytest.mark.parametrize("kind", ["llama", "gpt_oss"])
def test_dropout_runs_eager_with_its_mask(kind, calls, caplog):
    """Attention dropout in training: eager attention, given the 4-D mask eager would have built."""
    model = _model(kind).train()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    ids, mask = _batch(3)
    kt._warned.clear()
    results = {}
    for impl in ("eager", "kreg"):
        model.set_attn_implementation(impl)
        torch.manual_seed(7)
        with caplog.at_level(logging.WARNING, logger=kt.__name__):
            results[impl] = model(input_ids=ids, attention_mask=mask).logits
    kept = mask.bool()
    assert torch.allclose(results["kreg"][kept], results["eager"][kept], rtol=0, atol=1e-5 if not HAS_GPU else 1e-2)
    assert "dropout 0.5" in caplog.text and not calls


def test_a_paged_cache_call_is_refused():
    """Continuous batching's block-table calls expect the attention to write the new keys into the paged
    cache: refused by name rather than answered from stale keys."""
    model = _model("llama")
    q = torch.randn(1, 4, 3, 16, device=DEVICE, dtype=DTYPE)
    k = torch.randn(1, 2, 3, 16, device=DEVICE, dtype=DTYPE)
    table = torch.zeros(1, 4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="block_table"):
        kt.make_attention()(model.model.layers[0].self_attn, q, k, k, None, block_table=table)


def test_output_attentions_runs_eager():
    model = _model("gpt_oss").eval()
    ids, mask = _batch(3)
    model.set_attn_implementation("kreg")
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert len(got.attentions) == 2 and all(a is not None for a in got.attentions)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert torch.equal(got.logits, want.logits)


@pytest.mark.skipif(HAS_GPU, reason="on a GPU the plain backend already runs the kernels")
@pytest.mark.parametrize("vendor", ["nvidia", "amd"])
def test_each_vendors_kernels_in_the_interpreter(vendor, calls):
    """GPT-OSS through a vendor's Triton kernels in the interpreter (fp16: the interpreter's bf16 dot
    is unreliable), prefill of a padded batch and a few decode steps, against eager in fp32."""
    name = kt.register(f"kreg_{vendor}", vendor=vendor)
    model = _model("gpt_oss").eval()
    ids, mask = _batch(3)
    want = _logits(model, "eager", ids, mask)
    model.half()
    got = _logits(model, name, ids, mask)
    kept = mask.bool()
    assert _rel(got[kept], want[kept]) < 5e-3
    model.set_attn_implementation(name)
    out = model.generate(input_ids=ids[:1], max_new_tokens=3, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    model.float().set_attn_implementation("eager")
    ref = model.generate(input_ids=ids[:1], max_new_tokens=3, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    for got_step, want_step in zip(out.logits, ref.logits, strict=True):
        assert _rel(got_step, want_step) < 5e-3
    assert {name for name, _ in calls} == {"sink_attention", "decode"}


def test_sinks_kept_in_fp32_follow_every_change_of_the_parameter():
    """Without gradients a layer's fp32 sinks are cast once and kept; an in-place update of the parameter
    and new data assigned to it (as `module.to` does) both reach the next call. In bf16 on any device (fp32
    sinks would be used as they are)."""
    model = _model("gpt_oss").eval().to(torch.bfloat16)
    ids, mask = _batch(3)
    sinks = model.model.layers[0].self_attn.sinks
    with torch.no_grad():
        assert kt._fp32_sinks(sinks) is kt._fp32_sinks(sinks)
    for change in ("in place", "new data"):
        with torch.no_grad():
            if change == "in place":
                sinks.mul_(-2.0)
            else:
                sinks.data = torch.randn_like(sinks) * 3
        got, want = _logits(model, "kreg", ids, mask), _logits(model, "eager", ids, mask)
        assert _rel(got[mask.bool()], want[mask.bool()]) < 3e-2, change


@pytest.mark.parametrize("kind,fullgraph", [("gpt_oss", True), ("llama", False)])
def test_generate_compiles_a_static_caches_steps(kind, fullgraph, calls, caplog):
    """A compiled static cache's decode steps (dynamo's eager backend), padded batch, step by step against
    eager. GPT-OSS's generate makes each step's masks before the compiled forward, so the hook's host
    reads stay outside and the forward is one graph (fullgraph=True: a break would raise); Llama's forward
    makes its mask inside, where the hook's host read breaks the graph (transformers' default
    fullgraph=False)."""
    from transformers import CompileConfig

    model = _model(kind).eval()
    ids, mask = _batch(3)
    config = CompileConfig(backend="eager", fullgraph=fullgraph)
    config._compile_all_devices = True  # transformers compiles on a GPU only unless told
    runs = {}
    with caplog.at_level(logging.WARNING, logger=kt.__name__):
        for impl in ("eager", "kreg"):
            torch._dynamo.reset()
            model.set_attn_implementation(impl)
            runs[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                        cache_implementation="static", compile_config=config, output_logits=True,
                                        return_dict_in_generate=True, pad_token_id=0)
    assert not _fallbacks(caplog), "kreg fell back to eager attention"
    assert calls, "no kreg op ran"
    _follows_eager(runs["eager"], runs["kreg"], ids.shape[1])
