"""The real weight quantizers of ``evaluation.weight_quant``: names parse into classes that own their
behaviour, every roundtrip keeps the shape and lands on its grid (idempotent where the format says
so), the bitsandbytes roundtrip is what ``bnb.nn.Linear4bit`` computes with, errors are in the range
the formats give on gaussian weights, and ``quantize_model_`` touches exactly the decoder linears."""

import logging
import sys

import pytest
import torch

from hf_symmetry.evaluation import weight_quant as wq
from hf_symmetry.testing import tiny_model

#: one or more names of every kind; hqq is optional (skipped where it is not installed)
NAMES = (
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "MXFP4",
    "hqq4g64-rtn",
    "hqq3g32-rtn",
    "bnb-nf4",
    "bnb-fp4",
    "bnb-nf4-g32",
    "bnb-fp4-g128",
)


def _gauss(out=96, inp=256, seed=0):
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed))


def _rel(A, W):
    return ((A - W).norm() / W.norm()).item()


def _needs(name):
    if name.startswith("hqq"):
        pytest.importorskip("hqq")
    if name.startswith("bnb"):
        pytest.importorskip("bitsandbytes")


def test_the_names_cover_every_kind():
    assert {type(wq.quantizer(n)) for n in NAMES} == set(wq.KINDS)


@pytest.mark.parametrize("name", NAMES)
def test_roundtrip_keeps_the_shape_and_quantizes(name):
    _needs(name)
    W = _gauss().to(torch.float64)
    R = wq.roundtrip(W, name)
    assert R.shape == W.shape and R.dtype == torch.float32 and torch.isfinite(R).all()
    assert 0.003 < _rel(R.double(), W) < 0.25, (name, _rel(R.double(), W))
    # at most 2**bits distinct values per group: the result sits on a grid
    q = wq.quantizer(name)
    groups = R.reshape(-1, q.group)
    bits = {"Q5_0": 5, "Q5_1": 5, "Q8_0": 8}.get(name, 3 if name.startswith("hqq3") else 4)
    assert max(len(torch.unique(g)) for g in groups) <= 2**bits


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "MXFP4", "bnb-nf4", "bnb-fp4", "bnb-nf4-g32"])
def test_a_quantized_weight_quantizes_to_itself(name):
    _needs(name)
    R = wq.roundtrip(_gauss(), name)
    assert torch.equal(wq.roundtrip(R, name), R)


def test_bnb_roundtrip_is_what_linear4bit_computes():
    bnb = pytest.importorskip("bitsandbytes")
    W, b = _gauss(96, 256), torch.randn(96, generator=torch.Generator().manual_seed(1))
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    lin = bnb.nn.Linear4bit(256, 96, compute_dtype=torch.float32, compress_statistics=False, quant_type="nf4")
    lin.weight = bnb.nn.Params4bit(
        W.clone(), requires_grad=False, quant_type="nf4", blocksize=64, compress_statistics=False
    )
    lin.bias = torch.nn.Parameter(b.clone())
    lin = lin.to("cpu").train()  # train mode: float32 matmul (eval on AVX512-BF16 CPUs repacks to bfloat16)
    with torch.no_grad():
        y = lin(x)
    ours = x @ wq.roundtrip(W, "bnb-nf4").T + b
    torch.testing.assert_close(y, ours, rtol=1e-6, atol=1e-5)
    # negative controls: the float weight, and the fp4 grid, give other outputs
    assert (y - (x @ W.T + b)).abs().max() > 0.1
    assert (y - (x @ wq.roundtrip(W, "bnb-fp4").T + b)).abs().max() > 0.1


def test_gaussian_relative_errors_and_bits():
    pytest.importorskip("bitsandbytes")
    W = _gauss(256, 512)
    err = {n: _rel(wq.roundtrip(W, n), W) for n in ("bnb-nf4", "bnb-fp4", "bnb-nf4-g32", "bnb-nf4-g128", "Q4_0")}
    assert 0.085 < err["bnb-nf4"] < 0.1, err  # NF4 at 64: 0.092
    assert 0.11 < err["bnb-fp4"] < 0.135, err
    assert err["bnb-nf4-g32"] < err["bnb-nf4"] < err["bnb-nf4-g128"] < 0.1, err
    assert 0.08 < err["Q4_0"] < 0.095, err
    assert wq.bits_per_weight("bnb-nf4") == 4.5 and wq.bits_per_weight("bnb-nf4-g32") == 5.0
    assert wq.bits_per_weight("Q4_0") == 4.5 and wq.bits_per_weight("hqq3g64-rtn") == 3.5


@pytest.mark.parametrize("bad", ["bnb-nf5", "bnb-nf4-g100", "Q4_K", "hqq5g64", "q4_0", ""])
def test_an_unknown_name_is_refused_with_the_list(bad):
    with pytest.raises(ValueError, match=r"unknown quantizer .*Q4_0.*hqq<bits>g<group>.*bnb-nf4"):
        wq.quantizer(bad)


def test_an_input_dimension_that_is_not_whole_groups_is_refused():
    pytest.importorskip("bitsandbytes")
    # bitsandbytes' blocks run over the flattened tensor: 576 = 4.5 blocks of 128 would straddle rows
    with pytest.raises(ValueError, match="groups of 128 along in"):
        wq.roundtrip(_gauss(16, 576), "bnb-nf4-g128")
    with pytest.raises(ValueError, match="groups of 32 along in"):
        wq.roundtrip(_gauss(16, 48), "Q4_0")


def _llama64():
    return tiny_model(
        "llama", dtype=torch.float32, hidden_size=64, num_attention_heads=8, head_dim=8, intermediate_size=128
    )


@pytest.mark.parametrize("name", ["Q4_0", "bnb-nf4"])
def test_quantize_model_changes_exactly_the_decoder_linears(name):
    _needs(name)
    model = _llama64()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = wq.quantize_model_(model, name)
    after = model.state_dict()
    linears = {f"model.{n}.weight" for n, _ in wq.decoder_linears(model)}
    assert len(linears) == 2 * 7
    err = ref = 0.0
    for key, W in before.items():
        if key in linears:
            assert torch.equal(after[key], wq.roundtrip(W, name)), key
            err += (after[key].double() - W.double()).pow(2).sum().item()
            ref += W.double().pow(2).sum().item()
        else:  # embeddings, norms, head
            assert torch.equal(after[key], W), key
    assert stats["relative_error"] == pytest.approx((err / ref) ** 0.5, rel=1e-12)


def test_quantize_model_checks_every_shape_before_changing_anything():
    model = tiny_model("llama", dtype=torch.float32)  # hidden 48, intermediate 80: not whole groups of 32
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="groups of 32 along in"):
        wq.quantize_model_(model, "Q4_0")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_decoder_linears_come_from_the_family_adapter():
    opt = tiny_model("opt", dtype=torch.float32)  # layers under model.decoder.layers
    names = [n for n, _ in wq.decoder_linears(opt)]
    assert len(names) == 2 * 6 and "layers.1.fc2" in names
    assert all(m is opt.get_submodule(f"model.decoder.{n}") for n, m in wq.decoder_linears(opt))


def test_the_kernel_notice_filter_sits_on_bitsandbytes_own_logger():
    pytest.importorskip("bitsandbytes")
    wq._bnb_functional()
    ops = sys.modules["bitsandbytes.backends.cpu.ops"]
    if hasattr(ops, "logger"):  # bitsandbytes >= 0.50 (0.47 logs no such notice)
        assert ops.logger is logging.getLogger("bitsandbytes.backends.cpu.ops")  # the logger filtered at import

    def record(msg):
        return logging.LogRecord(
            "bitsandbytes.backends.cpu.ops", logging.WARNING, "ops.py", 1, msg, ("No module named 'kernels'",), None
        )

    notice = wq._DropKernelsHubNotice()
    assert not notice.filter(record("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please ..."))
    assert notice.filter(record("something else: %s"))  # only that notice
    assert not logging.getLogger("bitsandbytes.backends.cpu.ops").filters  # removed after the import
