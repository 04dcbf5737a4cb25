"""The final-state tap under torch.compile (Inductor, CPU): the buffer receives the norm's
residual (the final pre-norm state) and the model's output is unchanged, bit for bit."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vllm_compat.runtime import final_state_tap  # noqa: E402


class FusedAddNorm(torch.nn.Module):
    """What vLLM's RMSNorm does: ``norm(x, residual)`` -> ``(normed(x + residual), x + residual)``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, hidden))

    def forward(self, x, residual=None):
        s = x if residual is None else x + residual
        out = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return out if residual is None else (out, s)


class Backbone(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(hidden, hidden)
        self.norm = FusedAddNorm(hidden)

    def forward(self, x):
        hidden_states, _ = self.norm(self.layer(x), x)  # the residual is discarded, as in vLLM
        return hidden_states


def _model(hidden=32):
    torch.manual_seed(0)
    return Backbone(hidden).eval()


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_tapped_norm_hands_out_the_final_state_and_keeps_the_output(backend):
    plain, tapped = _model(), _model()
    sink = final_state_tap.install(tapped.norm, rows=64, hidden_size=32, dtype=torch.float32,
                                   device=torch.device("cpu"))
    run = torch.compile(tapped, backend=backend, dynamic=True)
    ref = torch.compile(plain, backend=backend, dynamic=True)  # the same compiler, no tap
    with torch.no_grad():
        for n in (7, 19, 64):  # several token counts through one compiled graph
            x = torch.randn(n, 32)
            assert torch.equal(run(x), ref(x))
            assert torch.equal(sink[:n], plain.layer(x) + x)
    final_state_tap.release(sink)


def test_a_step_larger_than_the_buffer_is_refused():
    m = _model()
    sink = final_state_tap.install(m.norm, rows=4, hidden_size=32, dtype=torch.float32,
                                   device=torch.device("cpu"))
    with torch.no_grad(), pytest.raises(RuntimeError, match="holds 4 tokens, the step has 5"):
        m(torch.randn(5, 32))
    final_state_tap.release(sink)


def test_an_op_whose_output_is_dropped_is_removed_by_the_compiler():
    """Why the tap's output must become the model's output: the same copy in an op whose
    result nobody uses never runs under Inductor (it is pure to the compiler)."""
    sink = torch.zeros(16, 8)

    @torch.library.custom_op("vllm_compat_test::dropped_tap", mutates_args=())
    def dropped_tap(x: torch.Tensor) -> torch.Tensor:
        sink[: x.shape[0]].copy_(x)
        return x.clone()

    @dropped_tap.register_fake
    def _(x):
        return torch.empty_like(x)

    def f(x):
        dropped_tap(x)  # result dropped
        return x * 2

    torch.compile(f, backend="inductor", dynamic=True)(torch.ones(4, 8))
    assert not sink.any()
