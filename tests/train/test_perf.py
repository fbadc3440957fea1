"""What fits and how fast (xlatrain.train.perf), for real: the memory plan before the first step
against the tensors that exist after it, the refusal of a run that cannot fit, FLOP counts against
hand-computed ones, and throughput and MFU where a run reports them. (Under DDP and FSDP in two
processes and under SPMD on XLA: tests/train/test_fsdp.py, from the same script's MEMORY line.)"""

import functools
import gc
import json
import logging
import math
import re
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import xlatrain
from xlatrain.backend import model_state
from xlatrain.recipes.lm.model import ByteGPT
from xlatrain.recipes.lm.recipe import byte_loss
from xlatrain.train import perf


def _regression(n, dim=8, out=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    return TensorDataset(x, x[:, :out] * 2 + 1)


def _live_tensors():
    gc.collect()
    with warnings.catch_warnings():  # the scan meets deprecated objects of torch.distributed
        warnings.simplefilter("ignore")
        return {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor)}


def _mse(model, data, n):
    x, y = data[:n]  # a batch of its own, as the Trainer's collate makes it (a view keeps all of its base)
    return nn.functional.mse_loss(model(x.clone()), y.clone())


def test_activations_and_flops_are_what_autograd_keeps_and_computes_for_each_sample():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    data = _regression(4)
    before = [p.detach().clone() for p in model.parameters()]
    profile = perf.profile_step(model, [], "cpu", functools.partial(_mse, model, data), samples=4, count=True)
    # Per sample, in float32: the input (8 values) for the first layer's weight gradient, ReLU's
    # output (16; the second layer's input is the same tensor), the outputs and the targets that
    # the loss keeps (4 + 4). Weights are parameters, not activations.
    assert profile.activations.total == perf.Sized(256, 512, 2, 4)
    assert profile.activations.at(32) == 32 * 128
    # Forward: 2 x (8x16 + 16x4) per sample. Backward: the first layer's weight gradient only (its
    # input needs none), the second layer's input and weight gradients.
    assert profile.flops_per_sample == 2 * (8 * 16 + 16 * 4) + 2 * 8 * 16 + 2 * (2 * 16 * 4)
    # Nothing of the measurement stays: no gradient, the mode and the weights as they were, and
    # no tensor of its graph (a saved tensor that references its own graph would leak each time).
    assert all(p.grad is None for p in model.parameters()) and model.training
    alive = _live_tensors()
    perf.profile_step(model, [], "cpu", functools.partial(_mse, model, data), samples=4, count=False)
    assert not _live_tensors() - alive  # no tensor made by it is still alive
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_measured_profile_is_one_forward_and_backward_at_the_whole_batch():
    # Where a runtime measures a step's memory (CUDA's step_memory), the profile is one pass at
    # the real batch inside that measurement: the same activations and FLOPs per sample as the
    # two small passes give, and the runtime's figure as step_peak (None: it did not fit).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    data = _regression(32)
    rows, passes = [], []

    def loss_of(n):
        rows.append(n)
        return _mse(model, data, n)

    def step_memory(step):  # the runtime's measurement around the pass; here, what ran inside it
        before = len(rows)
        step()
        passes.append(rows[before:])
        return 12345

    profile = perf.profile_step(model, [], "cpu", loss_of, samples=32, count=True, measure=step_memory)
    assert rows == [32] and passes == [[32]]  # one forward, inside the measurement
    assert profile.step_peak == 12345 and profile.rows == 32
    assert profile.activations.at(32) == 32 * 128 and profile.activations.at(64) == 64 * 128
    assert profile.flops_per_sample == 2 * (8 * 16 + 16 * 4) + 2 * 8 * 16 + 2 * (2 * 16 * 4)
    assert all(p.grad is None for p in model.parameters())  # its backward ran; the gradients are dropped
    assert perf.profile_step(model, [], "cpu", loss_of, samples=32, count=False,
                             measure=lambda step: (step(), None)[1]).step_peak is None


def test_the_state_an_optimizer_already_holds_is_counted_once_per_tensor_on_its_device():
    # A second fit's measured pass holds the optimizer's state from the first: the plan takes it
    # out of the measurement and adds it once, as the optimizer holds it.
    from xlatrain.backend.model_state import optimizer_state_bytes

    model = nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert optimizer_state_bytes(opt, torch.device("cpu")) == 0
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    weights = sum(p.numel() * 4 for p in model.parameters())
    steps = sum(s["step"].numel() * s["step"].element_size() for s in opt.state.values())
    assert optimizer_state_bytes(opt, torch.device("cpu")) == 2 * weights + steps
    assert optimizer_state_bytes(opt, torch.device("meta")) == 0  # another device's tensors are not this one's


def test_the_measured_step_runs_as_training_runs_and_leaves_statistics_and_random_state_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 4)).eval()
    stats = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    acts = perf.profile_step(model, [], "cpu", functools.partial(_mse, model, _regression(4)),
                             samples=4, count=False).activations
    # Per sample, in float32: the input (8 values), batch norm's input (16), dropout's scaled mask
    # (16) and output (16, the last layer's input), the loss's output and target (4 + 4); per
    # batch: batch norm's saved mean and inverse deviation (2 x 16). Its running statistics, which
    # its backward reads too, are buffers: the model's own memory.
    per_sample, per_batch = 4 * (8 + 16 + 16 + 16 + 4 + 4), 4 * 2 * 16
    assert acts.total == perf.Sized(2 * per_sample + per_batch, 4 * per_sample + per_batch, 2, 4)
    assert acts.at(100) == 100 * per_sample + per_batch
    assert not model.training and all(torch.equal(a, b) for a, b in zip(stats, model.buffers()))
    assert torch.equal(rng, torch.get_rng_state()) is False  # dropout drew: the Trainer puts it back
    # Batch norm in training mode needs two samples per channel: a batch of one is measured whole.
    one = perf.profile_step(nn.Linear(8, 4), [], "cpu", functools.partial(_mse, nn.Linear(8, 4), _regression(1)),
                            samples=1, count=False).activations
    assert one.total.small == one.total.large == 1


def test_checkpointed_units_keep_their_inputs_and_one_unit_at_a_time():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Block(), Block(), Block())
    units = list(model)[1:]
    acts = perf.profile_step(model, units, "cpu", functools.partial(_mse, model, _regression(4, out=8)),
                             samples=4, count=False).activations
    # Per sample, in float32: outside the blocks, the first layer's input (8 values) and the loss's
    # output and target (8 + 8); inside each block, its input for the up layer's weight gradient
    # (8) and ReLU's output (32), which the down layer reads too.
    assert acts.outside == perf.Sized(8 * 24, 16 * 24, 2, 4)
    assert acts.largest_unit == perf.Sized(8 * 40, 16 * 40, 2, 4)
    assert acts.unit_inputs == perf.Sized(8 * 8 * 3, 16 * 8 * 3, 2, 4)
    assert acts.total.at(10) == 10 * 4 * (24 + 3 * 40)
    assert acts.at(10, checkpointed=True) == 10 * 4 * (24 + 3 * 8 + 40)


def test_the_lm_flop_formula_for_a_known_config_and_torch_s_counter():
    model = ByteGPT(context=16, width=32, layers=2, heads=4)
    # Matmul weights: the 256x32 token embedding (tied: the output layer) and per block qkv 3x32x32,
    # proj 32x32, MLP 2 x 4x32x32 = 8192 + 2 x 12288 = 32768. 6 per weight per token over 16 tokens,
    # and attention 12 x 2 layers x 32 x 16 x 16.
    assert model.train_flops_per_sample() == 6 * 32768 * 16 + 12 * 2 * 32 * 16 * 16 == 3_342_336
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    counted = perf.count_flops(lambda: byte_loss(model(tokens), tokens)["loss"].backward())
    # The counter also counts the scores that attention's backward pass recomputes (one more
    # query-key product per layer): model FLOPs leave recomputation out.
    assert counted / 2 == model.train_flops_per_sample() + 2 * 2 * 32 * 16 * 16


class _Tied(nn.Module):
    """An embedding tied to the output layer, a frozen layer and two repeated blocks."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16)) for _ in range(2))
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.frozen(self.embed(tokens))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h).mean(dim=1)


def _tokens(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32, (n, 6), generator=g)
    return TensorDataset(tokens, tokens[:, 0])


def test_in_one_process_the_plan_equals_the_real_state_and_throughput_is_reported(tmp_path, caplog):
    torch.manual_seed(0)
    trainer = xlatrain.Trainer(
        _Tied(), nn.CrossEntropyLoss(), functools.partial(torch.optim.AdamW, lr=1e-3),
        config=xlatrain.TrainConfig(epochs=1, batch_size=8, run_dir=str(tmp_path / "run"), log_every=2),
        backend="cpu",
    )
    with caplog.at_level("INFO", logger="xlatrain"):
        # 6 steps: the progress line at step 2 is the warm-up's (no rate), the one at step 4 has rates.
        history = trainer.fit(_tokens(48), _tokens(8, 1))
    plan = trainer.memory_plan.as_dict()
    assert plan["optimizer_source"] == "AdamW's state per parameter"
    tokens, targets = _tokens(4, 2)[:]
    nn.CrossEntropyLoss()(trainer.model(tokens), targets).backward()
    real = trainer.strategy.state_bytes(trainer.model, trainer.optimizer)
    # The tied weight counts once; the frozen layer has no gradient and no optimizer state; AdamW
    # keeps two tensors per parameter and a float32 step count each.
    assert {k: plan[k] for k in real} == real
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    assert real["optimizer"] == 2 * real["gradients"] + 4 * len(trained)
    assert real["parameters"] - real["gradients"] == (16 * 16 + 16) * 4
    text = caplog.text
    assert "memory per device, before the first step: parameters" in text and "of " in text
    assert "model FLOPs: " in text and "per sample (torch's FLOP counter, one forward and backward pass)" in text
    assert "samples/s, MFU " in text  # each progress line
    assert history[0]["samples_per_s"] > 0 and 0 < history[0]["mfu"] < 1
    diag = json.loads((tmp_path / "run" / "diagnostics.json").read_text())
    assert diag["memory"]["estimate"] == trainer.memory_plan.total and diag["memory"]["measured_peak"] > 0
    assert diag["throughput"]["flops_per_sample"] > 0 and diag["throughput"]["peak_per_device"] > 0


def test_a_model_that_cannot_fit_a_stated_device_is_refused_before_its_first_step(tmp_path):
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(256, 256)

        def forward(self, x):
            return nn.functional.gelu(self.linear(x))

    def trainer(run, batch, accum=1):
        torch.manual_seed(0)
        model = nn.Sequential(*(Layer() for _ in range(4)), nn.Linear(256, 4))
        return model, xlatrain.Trainer(
            model, nn.MSELoss(), functools.partial(torch.optim.Adam, lr=1e-3),
            config=xlatrain.TrainConfig(epochs=1, batch_size=batch, grad_accum_steps=accum, run_dir=str(tmp_path / run)),
            backend=xlatrain.BackendConfig(accelerator="cpu", device_memory="5MB"),
        )

    data = _regression(512, dim=256)
    # Parameters 1.06 MB, gradients as much, Adam's state twice that: 4.2 MB before any activation.
    model, big = trainer("big", 256)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(xlatrain.DoesNotFitError) as refused:
        big.fit(data)
    message = str(refused.value)
    assert "cannot fit one device" in message and "more than the 5.0 MB the device holds (5MB as stated)" in message
    assert "parameters 1.1 MB + gradients 1.1 MB + optimizer state 2.1 MB + activations" in message
    for fix in ("precision='bf16'", "activation_checkpointing=True", "batch_size=", "strategy='fsdp'"):
        assert fix in message
    fits = [line for line in message.splitlines() if line.startswith("  - ")]
    assert any("batch_size=" in line for line in fits)
    # What fits leaves room for the runtime's temporaries: at most 90% of the device.
    assert all(float(line.rsplit(": ", 1)[1].split()[0]) <= 4.5 for line in fits)
    assert "with precision='bf16' and activation_checkpointing=True" in message  # the changes together
    # The figures, for a caller that catches the refusal: on the error and on the Trainer.
    assert refused.value.plan is big.memory_plan and big.memory_plan.total > big.memory_plan.capacity == 5e6
    assert big.memory_plan.summary(capacity=False) in message
    # Refused before work: no step taken, nothing written, not even the run directory.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not (tmp_path / "big").exists()
    # The batch it names fits that device, with the same global batch: that run trains.
    named = next(line for line in fits if "batch_size=" in line)
    batch, accum = int(named.split("batch_size=")[1].split()[0]), int(named.split("grad_accum_steps=")[1].split()[0])
    assert batch * accum == 256
    _, smaller = trainer("smaller", batch, accum)
    history = smaller.fit(data)
    assert math.isfinite(history[0]["train_loss"]) and smaller.memory_plan.total <= 5e6

    # Where nothing named fits, the changes together neither, the refusal says so, and what is left.
    with pytest.raises(xlatrain.DoesNotFitError) as refused:
        xlatrain.Trainer(
            nn.Sequential(*(Layer() for _ in range(4)), nn.Linear(256, 4)), nn.MSELoss(),
            functools.partial(torch.optim.Adam, lr=1e-3),
            config=xlatrain.TrainConfig(epochs=1, batch_size=256, run_dir=str(tmp_path / "tiny")),
            backend=xlatrain.BackendConfig(accelerator="cpu", device_memory=20_000),
        ).fit(data)
    message = str(refused.value)
    assert "None of these fits: " in message and "combine them" not in message, message
    assert message.endswith("Lower the batch size or the model's size, or shard it (strategy='fsdp') over more devices.")


def test_a_device_from_the_table_names_its_memory():
    from xlatrain.backend.hardware import DEVICE_SPECS, parse_memory

    assert parse_memory("v5e") == (16 * 2**30, f"tpu-v5e ({DEVICE_SPECS['tpu-v5e'].source})")
    assert parse_memory("16GiB")[0] == parse_memory("tpu-v5e")[0] and parse_memory("24GB")[0] == 24 * 10**9
    with pytest.raises(ValueError, match=r"device_memory='16 bytes please' is not valid: .*'16GB'.*tpu-v5e"):
        xlatrain.BackendConfig(device_memory="16 bytes please")
    # A malformed number is named with the forms it takes (it was float()'s own message), and a
    # device of no memory is refused (it was taken, and every run refused as not fitting).
    for bad in ("1.5.3GB", "0GB", "0.0MiB", 0.5):
        with pytest.raises(ValueError, match=rf"device_memory={re.escape(repr(bad))} is not valid: give bytes \(more than 0\)"):
            xlatrain.BackendConfig(device_memory=bad)
    assert parse_memory(".5GB")[0] == 5 * 10**8


class _SharedState(torch.optim.Optimizer):
    """Not torch.optim's: one state tensor per group, kept under its first parameter."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            first = group["params"][0]
            total = self.state[first].setdefault("sizes", torch.zeros(len(group["params"]), device=first.device))
            total += 1
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"])


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    lambda ps: torch.optim.Adam([{"params": ps[:3], "amsgrad": True}, {"params": ps[3:]}], lr=1e-3),
    lambda ps: torch.optim.SGD([{"params": ps[:4], "momentum": 0.9}, {"params": ps[4:]}], lr=0.1),
    lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True),
    lambda ps: torch.optim.Adagrad(ps, lr=0.1),  # makes its state as it is built: counted from it
    lambda ps: _SharedState([{"params": ps[:2]}, {"params": ps[2:]}]),
], ids=["adamw", "adam-amsgrad-in-one-group", "sgd-momentum-in-one-group", "rmsprop-centered", "adagrad", "shared-state"])
def test_the_planned_optimizer_state_is_the_state_a_real_step_makes(make):
    """Repeated blocks are stepped once per kind of parameter on meta tensors; the count must be
    what a real step of the real optimizer holds, group settings and a frozen layer included."""
    torch.manual_seed(0)
    model = _Tied()
    params = [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
    optimizer = make(params)
    def local_part(t):
        return t.shape, t.dtype

    plan = model_state.planned_state_bytes(model, optimizer, local_part)
    name = type(optimizer).__name__
    assert plan["optimizer_source"] == ("its state" if optimizer.state else f"{name}'s state per parameter"
                                        if name in ("Adam", "AdamW", "SGD") else f"one step of {name} on meta tensors")
    tokens, targets = _tokens(4, 2)[:]
    nn.CrossEntropyLoss()(model(tokens), targets).backward()
    optimizer.step()
    real = model_state.state_bytes(model, optimizer)
    assert plan["optimizer"] == real["optimizer"] > 0


def test_an_optimizer_holding_a_parameter_outside_the_model_is_planned_by_its_kinds_usual_count():
    """A parameter the optimizer steps but the model does not hold (a loss's own weight) has no part
    known to the plan: the plan falls back to the usual count, as it does for an optimizer it
    cannot rebuild, instead of failing before the first step."""
    model = _Tied()
    extra = nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW([*model.parameters(), extra], lr=1e-3)
    plan = model_state.planned_state_bytes(model, optimizer, lambda t: (t.shape, t.dtype))
    assert plan["optimizer_source"] == "estimated: 2 tensor(s) per parameter"
    assert plan["optimizer"] == 2 * plan["gradients"]


class _AdamWithMore(torch.optim.AdamW):
    """A subclass that keeps more state than AdamW: counted by a meta step, not AdamW's layout."""

    @torch.no_grad()
    def step(self):
        super().step()
        for p in self.state:
            self.state[p].setdefault("extra", torch.zeros_like(p))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("settings", [
    (torch.optim.AdamW, {}), (torch.optim.AdamW, {"fused": True}), (torch.optim.Adam, {"amsgrad": True, "foreach": True}),
    (torch.optim.Adam, {"foreach": False, "weight_decay": 0.1}), (torch.optim.SGD, {"momentum": 0.9, "fused": True}),
    (torch.optim.SGD, {"momentum": 0.0}), (_AdamWithMore, {}),
], ids=["adamw", "adamw-fused", "adam-amsgrad", "adam-single-tensor", "sgd-fused-momentum", "sgd-plain", "subclass"])
def test_adam_and_sgd_state_is_known_without_a_step_and_equals_a_real_step(settings, dtype):
    """Adam's, AdamW's and SGD's state is counted from their settings (with a meta step the count
    took 6-10 ms of CUDA start-up); the count must be what their real first step makes: fused,
    foreach and single-tensor steps, amsgrad, momentum or none, frozen parameters in the groups, in
    float32, bfloat16 and float64 (the default dtype then, which the step counts follow), 0-d
    state included or left out (XLA's count). Capturable steps need a GPU and are not run here."""
    kind, options = settings
    torch.set_default_dtype(torch.float64 if dtype == torch.float64 else torch.float32)
    try:
        torch.manual_seed(0)
        model = _Tied().to(dtype)
        params = list(model.parameters())  # the frozen layer's too: no gradient, so no state
        assert not all(p.requires_grad for p in params)
        optimizer = kind([{"params": params[:2], "lr": 1e-3}, {"params": params[2:]}], lr=1e-3, **options)
        parts = {id(p): (p.shape, p.dtype) for p in model.parameters()}
        known = {c: model_state._known_state_bytes(optimizer, parts, c) for c in (True, False)}
        tokens, targets = _tokens(4, 2)[:]
        nn.CrossEntropyLoss()(model(tokens).float(), targets).backward()
        optimizer.step()
    finally:
        torch.set_default_dtype(torch.float32)
    real = {c: sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and (c or v.dim() > 0)) for c in (True, False)}
    if kind is _AdamWithMore:
        assert known == {True: None, False: None}
    else:
        assert known == real
        assert real[False] > 0 or options == {"momentum": 0.0}


class _LateBranch(nn.Module):
    """A head that gets its first gradient at the second step (a multi-task or gated branch)."""

    def __init__(self):
        super().__init__()
        self.body, self.late, self.calls = nn.Linear(16, 4), nn.Linear(16, 4), 0

    def forward(self, x):
        self.calls += self.training and torch.is_grad_enabled()
        return self.body(x) + (self.late(x) if self.calls > 1 or not self.training else 0)


@pytest.mark.parametrize("options", [{"momentum": 0.9}, {"momentum": 0.9, "nesterov": True}, {}],
                         ids=["momentum", "nesterov", "plain"])
def test_sgd_with_momentum_keeps_torchs_default_step_and_trains_a_branch_that_starts_late(options, tmp_path):
    """torch's fused SGD raised TypeError at the step where a branch got its first gradient (some
    parameters with a momentum buffer, others without one yet); its default step takes that."""
    def fit(run, **fused):
        torch.manual_seed(0)
        trainer = xlatrain.Trainer(_LateBranch(), nn.MSELoss(), functools.partial(torch.optim.SGD, lr=0.05, **options, **fused),
                                   config=xlatrain.TrainConfig(epochs=1, batch_size=16, run_dir=str(tmp_path / run),
                                                               tensorboard=False), backend="cpu")
        return trainer, trainer.fit(_regression(128, dim=16))

    trainer, history = fit("auto")
    assert trainer.optimizer.defaults["fused"] is (None if options else True)
    assert math.isfinite(history[0]["train_loss"])
    _, expected = fit("default", fused=False)
    assert history[0]["train_loss"] == pytest.approx(expected[0]["train_loss"], rel=1e-5)


@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad])
def test_an_optimizer_with_a_fused_cpu_kernel_is_built_fused_said_and_trains_as_torchs_default(kind, tmp_path, caplog):
    """Adagrad makes its state as it is built: it was left unfused as if it had stepped."""
    caplog.set_level(logging.INFO, logger="xlatrain")

    def fit(run, **options):
        torch.manual_seed(0)
        trainer = xlatrain.Trainer(
            nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), nn.MSELoss(),
            functools.partial(kind, lr=0.05, **options),
            config=xlatrain.TrainConfig(epochs=2, batch_size=16, run_dir=str(tmp_path / run), tensorboard=False),
            backend="cpu")
        return trainer, trainer.fit(_regression(128, dim=16))

    fused, history = fit("fused")
    assert fused.optimizer.defaults["fused"] is True and type(fused.optimizer) is kind
    assert f"optimizer: {kind.__name__} with fused=True" in caplog.text
    caplog.clear()
    default, expected = fit("default", fused=False)
    assert default.optimizer.defaults["fused"] is False and "optimizer:" not in caplog.text  # the factory's choice
    assert [r["train_loss"] for r in history] == pytest.approx([r["train_loss"] for r in expected], rel=1e-5)


def test_fp16_on_the_cpu_says_why_it_has_no_mfu(tmp_path, caplog):
    """It said the CPU was 'not in xlatrain's table', where the CPU's peak is measured in the run's
    dtype: float16 is the one dtype it is not measured in."""
    caplog.set_level(logging.INFO, logger="xlatrain")
    trainer = xlatrain.Trainer(
        nn.Linear(8, 4), nn.MSELoss(), functools.partial(torch.optim.SGD, lr=0.01),
        config=xlatrain.TrainConfig(epochs=1, batch_size=16, precision="fp16", run_dir=str(tmp_path), tensorboard=False),
        backend="cpu")
    trainer.fit(_regression(64))
    assert trainer.throughput.peak_per_device is None
    assert "no float16 peak FLOP/s known for this device (not measured: a CPU has no fast float16 matmul" in caplog.text


@pytest.mark.parametrize("kind", [torch.optim.SGD, torch.optim.Adagrad])
def test_a_model_with_sparse_embeddings_keeps_torchs_default_step(kind, tmp_path):
    """No fused kernel takes a sparse gradient: a fused SGD or Adagrad raised at the first step."""

    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(50, 8, sparse=True), nn.Linear(8, 2)

        def forward(self, tokens):
            return self.head(self.embed(tokens).mean(1))

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, 50, (64, 5), generator=g), torch.randint(0, 2, (64,), generator=g))
    torch.manual_seed(0)
    trainer = xlatrain.Trainer(Bag(), nn.CrossEntropyLoss(), functools.partial(kind, lr=0.1),
                               config=xlatrain.TrainConfig(epochs=1, batch_size=16, run_dir=str(tmp_path),
                                                           tensorboard=False), backend="cpu")
    assert trainer.optimizer.defaults["fused"] is None
    assert math.isfinite(trainer.fit(data)[0]["train_loss"])


def test_a_sparse_gradient_the_model_makes_itself_under_a_fused_step_names_the_fix(tmp_path):
    """A functional sparse embedding is no module the Trainer can see before the first backward."""

    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.table, self.head = nn.Parameter(torch.randn(50, 8)), nn.Linear(8, 2)

        def forward(self, tokens):
            return self.head(nn.functional.embedding(tokens, self.table, sparse=True).mean(1))

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, 50, (64, 5), generator=g), torch.randint(0, 2, (64,), generator=g))

    def trainer(**options):
        return xlatrain.Trainer(Functional(), nn.CrossEntropyLoss(), functools.partial(torch.optim.Adagrad, lr=0.1, **options),
                                config=xlatrain.TrainConfig(epochs=1, batch_size=16, run_dir=str(tmp_path / str(options)),
                                                            tensorboard=False), backend="cpu")

    with pytest.raises(RuntimeError) as raised:
        trainer().fit(data)
    assert any("pass fused=False in the optimizer factory" in note for note in raised.value.__notes__)
    assert math.isfinite(trainer(fused=False).fit(data)[0]["train_loss"])  # the fix named
