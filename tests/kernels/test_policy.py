"""The decoding step's kernel policy in one place (issue #37, headspace.kernels.policy): packing, the Q8_0
unembedding and the rows decided from a model's description and the CPU, with every fallback forced as
before."""

from __future__ import annotations

import pytest
import torch

from headspace import Decoder, ModelConfig
from headspace.decode import choose_pack_rows, product_weights
from headspace.decode.loop import choose_unembed_q8, choose_unembed_rows
from headspace.decode.step import products_of
from headspace.kernels import cpu, policy, prepack, q8_0

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("automatic_choices")]

#: SmolLM2-135M's shape (its config.json): 30 layers, 9 heads of 64 over 3 key/value heads, SwiGLU 1536
SMOLLM2 = {
    "vocab_size": 49152, "d_model": 576, "n_layers": 30, "n_heads": 9, "n_kv_heads": 3, "d_mlp": 1536,
    "max_seq_len": 2048, "positions": "rotary", "norm_kind": "rmsnorm", "mlp_kind": "gated", "act": "silu",
    "bias": False, "tie_embeddings": True,
}  # fmt: skip
SMALL = [
    {},  # GPT-2-like: tied, biases, plain MLP
    {"positions": "rotary", "norm_kind": "rmsnorm", "mlp_kind": "gated", "act": "silu", "bias": False,
     "n_kv_heads": 1, "tie_embeddings": False},  # Llama-like, grouped keys, untied
    {"positions": "rotary", "norm_kind": "rmsnorm", "mlp_kind": "gated", "act": "gelu_tanh", "bias": False,
     "n_kv_heads": 1, "norm": "sandwich", "norm_offset": 1.0, "qk_norm": "head", "sliding_window": 3,
     "layer_types": ["sliding", "full"], "embed_scale": 4.0},  # Gemma-3-like
]  # fmt: skip


def small(**kw: object) -> Decoder:
    args = {"vocab_size": 29, "d_model": 16, "n_layers": 2, "n_heads": 4, "d_mlp": 11, "max_seq_len": 19}
    return Decoder(ModelConfig(arch="decoder", **{**args, **kw})).eval()


def smollm2_products() -> policy.StepProducts:
    """SmolLM2-135M described from its configuration alone (no weights are made)."""
    c = ModelConfig(arch="decoder", **SMOLLM2)
    return policy.StepProducts(tuple(c.block_specs()), c.vocab_size, c.d_model, float32=True)


@pytest.fixture
def mkl_with_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """MKL's packed linear present and plenty of memory, whatever this machine's torch and load."""
    monkeypatch.setattr(prepack, "prepack_available", lambda: True)
    monkeypatch.setattr(prepack, "available_memory_bytes", lambda: 10**12)


@pytest.mark.parametrize("kw", SMALL)
def test_the_description_counts_the_bytes_of_every_product(kw: dict) -> None:
    """The bytes the policy reads off the block descriptions are those of the weights a step multiplies
    by (headspace.decode.product_weights), and none at a reduced precision."""
    model = small(**kw)
    products = products_of(model)
    assert products.stepped and products.float32 and not products.unembed_bias
    assert products.weight_bytes == sum(w.numel() * w.element_size() for w in product_weights(model))
    unembed = product_weights(model)[-1]
    assert products.unembed_bytes == unembed.numel() * unembed.element_size()
    model.to_precision("bfloat16")
    assert not products_of(model).float32 and products_of(model).weight_bytes == 0


def test_pruned_heads_count_as_the_description_says() -> None:
    from headspace import prune_heads

    model = small()
    prune_heads(model, {0: [1, 2]})
    assert products_of(model).weight_bytes == sum(w.numel() * 4 for w in product_weights(model))


@pytest.mark.usefixtures("mkl_with_memory")
def test_smollm2_is_packed_for_batches_from_its_description_alone() -> None:
    products = smollm2_products()
    assert 500e6 < products.weight_bytes < 560e6  # 135M parameters (tied: the embedding counted once)
    assert policy.choose_kernels(products, 8, None, q8=False) == policy.KernelChoice(pack_rows=8)
    assert policy.pack_rows(products, 1, None) is None  # one row: MKL's matrix-vector kernel
    assert policy.pack_rows(products, 8, False) is None and policy.pack_rows(products, 3, True) == 3
    with pytest.raises(TypeError, match="prepack must be None"):
        policy.pack_rows(products, 8, "yes")  # type: ignore[arg-type]
    with cpu.force_fallback("prepack"):
        assert policy.pack_rows(products, 8, None) is None
        assert policy.pack_rows(products, 8, True) == 8  # asked for: packed (the fallback is the choice's)


@pytest.mark.usefixtures("mkl_with_memory")
def test_the_unembedding_alone_is_packed_at_one_row_where_it_pays(monkeypatch: pytest.MonkeyPatch) -> None:
    products = smollm2_products()
    assert products.unembed_bytes == 49152 * 576 * 4 and products.unembed_bytes >= prepack.MIN_PACK_BYTES
    assert policy.choose_kernels(products, 1, None, q8=False) == policy.KernelChoice(unembed_rows=1)
    assert policy.unembed_rows(products, 2, None) is None and policy.unembed_rows(products, 1, True) is None
    monkeypatch.setenv(cpu.ENV, "prepack")
    assert policy.choose_kernels(products, 1, None, q8=False) == policy.KernelChoice()
    monkeypatch.delenv(cpu.ENV)
    monkeypatch.setattr(prepack, "available_memory_bytes", lambda: 2 * products.unembed_bytes - 1)
    assert policy.unembed_rows(products, 1, None) is None  # the copy must fit twice


@pytest.mark.usefixtures("mkl_with_memory")
def test_without_every_blocks_step_nothing_is_packed_for_it() -> None:
    import dataclasses

    products = dataclasses.replace(smollm2_products(), stepped=False)
    assert policy.choose_kernels(products, 8, None) == policy.KernelChoice()
    assert policy.choose_kernels(products, 1, None) == policy.KernelChoice()
    assert policy.pack_rows(products, 8, True) == 8  # asked for


def test_q8_0_is_chosen_from_the_description_and_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    builds: list[int] = []
    monkeypatch.setattr(policy.library, "start_build", lambda: builds.append(1))
    monkeypatch.setattr(q8_0, "q8_0_available", lambda: True)
    monkeypatch.setattr(q8_0, "simd_level", lambda: 1)
    products = smollm2_products()
    assert policy.unembed_q8(products, 1) and policy.unembed_q8(products, q8_0.MAX_ROWS) and builds
    assert policy.choose_kernels(products, 1, None).unembed_q8
    assert not policy.choose_kernels(products, 1, None, q8=False).unembed_q8  # use_cache=False
    assert not policy.unembed_q8(products, q8_0.MAX_ROWS + 1)
    assert not policy.unembed_q8(dataclasses.replace(products, unembed_bias=True), 1)
    assert not policy.unembed_q8(dataclasses.replace(products, float32=False), 1)
    assert not policy.unembed_q8(dataclasses.replace(products, vocab_size=64), 1)  # stays in the caches
    with cpu.force_fallback("q8_0"):
        assert not policy.unembed_q8(products, 1)
    monkeypatch.setenv(cpu.ENV, "q8_0")
    assert not policy.unembed_q8(products, 1)
    monkeypatch.delenv(cpu.ENV)
    monkeypatch.setattr(q8_0, "simd_level", lambda: 0)  # plain C++ is slower than the GEMM
    assert not policy.unembed_q8(products, 1)


def test_decodes_choices_are_the_policys(monkeypatch: pytest.MonkeyPatch) -> None:
    """headspace.decode's choose_* functions and generate ask the policy, with the model's description."""
    model = small(**SMALL[1])
    nbytes = sum(w.numel() * 4 for w in product_weights(model))
    asked: list[tuple[int, int, bool | None]] = []
    real_rows, real_choose = policy.pack_rows, policy.choose_kernels

    def rows(products: policy.StepProducts, batch: int, option: bool | None) -> int | None:
        asked.append((products.weight_bytes, batch, option))
        return real_rows(products, batch, option)

    def choose(products: policy.StepProducts, batch: int, option: bool | None, **kw: bool) -> object:
        asked.append((products.weight_bytes, batch, option))
        return real_choose(products, batch, option, **kw)

    monkeypatch.setattr(policy, "pack_rows", rows)
    monkeypatch.setattr(policy, "choose_kernels", choose)
    choose_pack_rows(model, 4, None)
    torch.manual_seed(0)
    assert model.generate(torch.randint(0, 29, (2, 3)), 2, temperature=0, prepack=False).shape == (2, 5)
    assert asked[:2] == [(nbytes, 4, None), (nbytes, 2, False)]
    assert choose_unembed_rows(model, 1, None) is None and choose_unembed_q8(model, 1) is None
