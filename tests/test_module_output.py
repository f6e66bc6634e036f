"""``module_loss(model, criterion, output="whole")``: the criterion sees the model's whole
output, so losses over several heads or an auxiliary loss the model returns can be written.

Compared in float64 with the plain-torch W-rank oracle (``user_models.oracle_run``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fzero
import user_models as um


class TwoHeads(torch.nn.Module):
    """A dict output: class logits, a regression head and a router-style auxiliary loss."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(6, 8)
        self.cls = torch.nn.Linear(8, 3)
        self.reg = torch.nn.Linear(8, 1)
        self.router = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.body(x))
        probs = self.router(h).softmax(-1)
        balance = (probs.mean(0) ** 2).sum()  # a load-balancing loss: only it trains the router
        return {"logits": self.cls(h), "value": self.reg(h).squeeze(-1), "aux_loss": balance}


def two_head_criterion(out: dict[str, torch.Tensor], target: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    labels, values = target
    return F.cross_entropy(out["logits"], labels) + F.mse_loss(out["value"], values) + 0.5 * out["aux_loss"]


def _two_head_data(n: int, batch: int) -> list:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(batch, 6, generator=g, dtype=torch.float64),
             (torch.randint(0, 3, (batch,), generator=g), torch.randn(batch, generator=g, dtype=torch.float64)))
            for _ in range(n)]


def _fzero(model, criterion, data, world, stage):
    comm = fzero.SimulatedWorld(world)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2, weight_decay=0.1), comm, stage=stage, alignment=4)
    step = fzero.make_train_step(fzero.module_loss(model, criterion, output="whole"), comm)
    for b in data:
        state, _ = step(state, comm.split_batch(b))
    return fzero.full_params(state.shard, comm)


def _assert_close(full, ref, tol):
    for name, p in ref.named_parameters():
        for row in full[name]:
            err = ((row - p.detach()).abs().max() / p.detach().abs().max()).item()
            assert err <= tol, f"{name}: relative error {err:.3g}"


def _adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("stage", [2, 3])
def test_dict_output_with_an_auxiliary_loss_matches_torch(stage):
    torch.manual_seed(0)
    model = TwoHeads().double()
    router0 = model.router.weight.detach().clone()
    data = _two_head_data(3, 4)
    ref, _, _ = um.oracle_run(model, _adamw, data, 2,
                              lambda m, b: two_head_criterion(m(b[0]), b[1]))
    units = dict(units=lambda name, m: name in ("cls", "router")) if stage == 3 else {}
    comm = fzero.SimulatedWorld(2)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2, weight_decay=0.1), comm, stage=stage,
                                   alignment=4, **units)
    step = fzero.make_train_step(fzero.module_loss(model, two_head_criterion, output="whole"), comm)
    for b in data:
        state, _ = step(state, comm.split_batch(b))
    _assert_close(fzero.full_params(state.shard, comm), ref, 1e-12)
    # the router is trained by the auxiliary loss alone: it moved
    assert not torch.equal(dict(ref.named_parameters())["router.weight"], router0)


def test_transformers_output_object_reaches_the_criterion():
    pytest.importorskip("transformers")
    from transformers.utils import ModelOutput

    seen = []

    def criterion(out, target):
        seen.append(type(out))
        # several heads of one output object: the logits and the last hidden state
        return um.lm_criterion(out.logits, target) + 1e-2 * out.hidden_states[-1].pow(2).mean()

    model = um.gpt2().double()
    model.config.output_hidden_states = True
    data = um.token_batches(2, 4)
    ref, _, _ = um.oracle_run(model, _adamw, data, 2, lambda m, b: criterion(m(b[0]), b[1]))
    full = _fzero(model, criterion, data, 2, stage=2)
    assert seen and all(issubclass(t, ModelOutput) for t in seen), seen
    _assert_close(full, ref, 1e-10)


def test_whole_output_upcasts_every_16_bit_tensor():
    seen = {}

    def criterion(out, target):
        seen.update({k: v.dtype for k, v in out.items()})
        return F.cross_entropy(out["logits"], target) + out["aux_loss"]

    model = TwoHeads()
    loss_fn = fzero.module_loss(model, criterion, output="whole")
    tensors = {n: p.detach().bfloat16().requires_grad_() for n, p in model.named_parameters()}
    loss = loss_fn(tensors, (torch.randn(4, 6), torch.tensor([0, 1, 2, 0])))
    assert loss.dtype == torch.float32
    assert seen == {"logits": torch.float32, "value": torch.float32, "aux_loss": torch.float32}


def test_output_option_errors():
    with pytest.raises(ValueError, match=r"output must be one of \('logits', 'whole'\), got 'all'"):
        fzero.module_loss(TwoHeads(), F.mse_loss, output="all")
    with pytest.raises(ValueError, match="output='whole'.*give one"):
        fzero.module_loss(TwoHeads(), output="whole")
