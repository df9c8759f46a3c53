"""rollout/embedded/linear.py: every backend computes x @ W.t() within the fp32 reduction bound of an
fp64 reference, for 1..300 rows, batched 3-D inputs, and weights below and above the size
where packing pays; the engine picks the packed backend only where it applies (fp32 on CPU),
a cache-resident weight multiplies few rows by the plain matmul, and one row of a streaming weight takes the
plain GEMV on one thread and the packed kernel on several."""
import pytest
import torch

from fp32_bounds import reduction_rtol
from rollout.embedded.linear import BACKENDS, PACKED_MIN_BYTES, PACKED_SMALL_MIN_ROWS, linear, pack, pick_backend

SMALL_OUT = 80  # 80 x 96 fp32: cache-resident
LARGE_OUT = PACKED_MIN_BYTES // (4 * 300) + 1  # x 300 fp32: just over the packing threshold


def needs_onednn(backend):
    if backend == "mkldnn" and pick_backend("cpu", torch.float32) != "mkldnn":
        pytest.skip("this torch has no oneDNN")


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("out, shape", [(SMALL_OUT, s) for s in [(1, 96), (2, 96), (4, 96), (16, 96), (3, 5, 96),
                                                                  (PACKED_SMALL_MIN_ROWS + 44, 96)]]
                         + [(LARGE_OUT, s) for s in [(1, 300), (2, 300), (16, 300)]])
def test_linear_matches_an_fp64_reference_within_the_reduction_bound(backend, out, shape):
    needs_onednn(backend)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out, shape[-1], generator=g)
    x = torch.randn(*shape, generator=g)
    got = linear(x, pack(w, backend))
    want = x.double() @ w.double().t()
    # Higham: |fl(sum) - sum| <= n u sum|terms|, per output element (plus the rounding of the result)
    bound = reduction_rtol(shape[-1], 1) * (x.abs().double() @ w.abs().double().t()) + want.abs() * 2.0 ** -24
    assert got.shape == want.shape
    assert ((got.double() - want).abs() <= bound).all()


def test_a_cache_resident_weight_uses_the_packed_kernel_only_for_many_rows():
    needs_onednn("mkldnn")
    g = torch.Generator().manual_seed(1)
    small = torch.randn(SMALL_OUT, 96, generator=g)
    x = torch.randn(4, 96, generator=g)
    assert torch.equal(linear(x, pack(small, "mkldnn")), x @ small.t())  # the plain matmul itself
    assert pack(small, "mkldnn").min_packed_rows == PACKED_SMALL_MIN_ROWS
    assert pack(torch.randn(LARGE_OUT, 300, generator=g), "mkldnn").min_packed_rows == 2


def test_packed_backend_is_chosen_only_for_fp32_on_cpu():
    assert pick_backend("cpu", torch.float64) == "dense"
    assert pick_backend("meta", torch.float32) == "dense"
    assert pick_backend("cpu", torch.float32, requested="dense") == "dense"


def test_packed_weights_follow_weight_loads(tmp_path):
    from spec_fixtures import markov_model

    from rollout.embedded.engine import Engine

    model = markov_model(noise=0.2)
    engine = Engine(model)
    name, param = next((n, p) for n, p in engine.model.named_parameters() if n.endswith("down_proj.weight"))
    x = torch.randn(2, param.shape[1])
    before = linear(x, engine.fast.layers[0].down)
    engine.load_weights([(name, param * 2)], version=1)
    after = linear(x, engine.fast.layers[0].down)
    assert torch.allclose(after, 2 * before, rtol=reduction_rtol(param.shape[1], 1) * 4, atol=1e-6)


@pytest.mark.parametrize("threads, kernel", [(1, "plain"), (2, "packed")])
def test_one_row_of_a_streaming_weight_uses_the_packed_kernel_only_on_several_threads(threads, kernel):
    needs_onednn("mkldnn")
    g = torch.Generator().manual_seed(2)
    w = pack(torch.randn(LARGE_OUT, 300, generator=g), "mkldnn")
    x = torch.randn(1, 300, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want = {"plain": lambda: x @ w.dense.t(),
                "packed": lambda: torch.ops.mkldnn._linear_pointwise(x, w.packed, None, "none", [], "")}[kernel]()
        assert torch.equal(linear(x, w), want)  # the kernel itself, bit for bit
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_computes_its_linear_and_follows_a_written_weight(backend, bias):
    """pack_linears swaps a network's nn.Linear for PackedLinear: the same parameter names and tensors, an
    output within the reduction bound of an fp64 x @ W.t() + b, and after an in-place load of a new weight
    (as a weight sync writes) the new weight's output, not the old packed copy's."""
    from rollout.embedded.linear import PackedLinear, pack_linears

    needs_onednn(backend)
    g = torch.Generator().manual_seed(2)
    net = torch.nn.Sequential(torch.nn.Linear(300, LARGE_OUT, bias=bias), torch.nn.SiLU()).requires_grad_(False)
    params = dict(net.named_parameters())
    pack_linears(net, backend)
    assert isinstance(net[0], PackedLinear) and dict(net.named_parameters()) == params
    x = torch.randn(2, 300, generator=g)
    for _ in range(2):
        w, b = net[0].weight.double(), net[0].bias.double() if bias else 0
        want = x.double() @ w.t() + b
        bound = reduction_rtol(300, 1) * (x.abs().double() @ w.abs().t()) + want.abs() * 2.0 ** -23
        got = net[0](x)
        assert ((got.double() - want).abs() <= bound).all()
        with torch.no_grad():
            net[0].weight.copy_(torch.randn(LARGE_OUT, 300, generator=g))
