"""AdamW variants: implementations agree, optimizer-in-backward == AdamW (also with grad
accumulation), bf16 state halves the memory and still trains, CPU offload == AdamW, and every
state_dict round trip resumes exactly."""

import copy
import dataclasses
import io

import pytest
import torch

from slipstream.config import load_config
from slipstream.errors import UserError
from slipstream.models.transformer import build_model, lm_loss
from slipstream.optimize.optimizers import (
    AdamWBf16State,
    CPUOffloadOptimizer,
    OptimizerInBackward,
    make_adamw,
    named_param_groups,
    optimizer_state_bytes,
    optimizer_state_devices,
)
from slipstream.train.setup import param_groups

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1
VOCAB, BATCH, SEQ = 257, 4, 32


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """This model is too small to gain from a second thread, and on a busy 2-core machine every
    tiny kernel's thread handoff can cost milliseconds: one thread makes this file ~2x faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_cfg():
    cfg = load_config(None, ["--model.preset=tiny", f"--train.seq_len={SEQ}"]).model
    return dataclasses.replace(cfg, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(20)]


@pytest.fixture(scope="module")
def initial_model(model_cfg):
    return build_model(model_cfg, "cpu", seed=0)


@pytest.fixture
def fresh_model(initial_model):
    """A new copy of the same initial weights (deepcopy keeps tied weights tied)."""
    return lambda: copy.deepcopy(initial_model)


def loss_of(model, batch):
    x, y = batch
    return lm_loss(model(x), y)


def train(model, optimizer, batches, scheduler=None):
    """The trainer's loop: backward -> step -> schedule -> zero_grad; returns the last loss."""
    for batch in batches:
        loss = loss_of(model, batch)
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.item()


def train_in_backward(model, optimizer, batches, accum=1):
    """Micro-batches of `accum`; the optimizer steps inside the last micro-batch's backward."""
    for start in range(0, len(batches), accum):
        for i, batch in enumerate(batches[start:start + accum]):
            optimizer.step_enabled = i == accum - 1
            (loss_of(model, batch) / accum).backward()


def train_accumulating(model, optimizer, batches, accum):
    for start in range(0, len(batches), accum):
        for batch in batches[start:start + accum]:
            (loss_of(model, batch) / accum).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def adamw(model, implementation="fused", state_dtype="fp32"):
    return make_adamw(param_groups(model, WD), LR, BETAS, EPS, WD, implementation, state_dtype)


def in_backward(model, implementation="fused", **kwargs):
    return OptimizerInBackward(named_param_groups(model, param_groups(model, WD)), LR, BETAS, EPS, WD,
                               implementation, **kwargs)


def assert_same_params(a, b, atol=0.0):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if atol == 0.0:
            assert torch.equal(p, q), name
        else:
            torch.testing.assert_close(p, q, rtol=0.0, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def round_trip(state_dict):
    """Through bytes, as a checkpoint does: nothing may alias the live optimizer."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# --- make_adamw ------------------------------------------------------------------------------

def test_implementations_agree(fresh_model, batches):
    """foreach == for-loop bitwise. fused rounds differently in the last bits: after 1 step
    |diff| <= 1.9e-9 (~2e-8 of each tensor's scale). Over 5 steps this grows to ~6e-8, except in
    the attention key biases, whose true gradient is 0 (softmax ignores a constant added to all
    logits of a row): their grads are rounding noise that Adam scales to lr-sized steps, so there
    the implementations differ by up to ~4e-6. 1e-5 (1% of one lr-sized step) covers both."""
    models = {}
    for implementation in ("for-loop", "foreach", "fused"):
        model = fresh_model()
        optimizer = adamw(model, implementation)
        assert optimizer.defaults["foreach"] is (implementation == "foreach")
        assert optimizer.defaults["fused"] is (implementation == "fused")
        train(model, optimizer, batches[:1])
        models[implementation, 1] = copy.deepcopy(model)
        train(model, optimizer, batches[1:5])
        models[implementation, 5] = model
    assert_same_params(models["foreach", 5], models["for-loop", 5])
    assert_same_params(models["fused", 1], models["for-loop", 1], atol=1e-8)
    assert_same_params(models["fused", 5], models["for-loop", 5], atol=1e-5)


def test_auto_picks_fused_and_bad_choices_are_user_errors(initial_model):
    assert make_adamw(initial_model.parameters(), LR, BETAS, EPS, WD).defaults["fused"] is True
    with pytest.raises(UserError, match="auto, for-loop, foreach, fused"):
        make_adamw(initial_model.parameters(), LR, BETAS, EPS, WD, implementation="fast")
    with pytest.raises(UserError, match="fp32, bf16"):
        make_adamw(initial_model.parameters(), LR, BETAS, EPS, WD, state_dtype="fp16")
    with pytest.raises(UserError, match="bf16"):
        make_adamw(initial_model.parameters(), LR, BETAS, EPS, WD, implementation="fused", state_dtype="bf16")
    with pytest.raises(UserError, match="auto, for-loop, foreach, fused"):
        in_backward(initial_model, implementation="fast")


# --- bf16 optimizer state --------------------------------------------------------------------

def test_bf16_state_matches_adamw_math_and_halves_memory(fresh_model, batches):
    # Step 1 computes in fp32 before any moment is rounded, so it must equal torch's for-loop
    # AdamW bitwise: this pins down decoupled weight decay, bias correction and eps.
    reference, model = fresh_model(), fresh_model()
    fp32 = adamw(reference, "for-loop")
    bf16 = adamw(model, "auto", "bf16")
    assert isinstance(bf16, AdamWBf16State)
    train(reference, fp32, batches[:1])
    train(model, bf16, batches[:1])
    assert_same_params(model, reference)

    # 20 steps: the loss tracks fp32 AdamW closely (measured: |diff| ~1e-5 at loss ~5.68).
    fp32_loss = train(reference, fp32, batches[1:20])
    bf16_loss = train(model, bf16, batches[1:20])
    assert abs(bf16_loss - fp32_loss) < 1e-3, (bf16_loss, fp32_loss)

    moments = [s[k] for s in bf16.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert moments and all(t.dtype == torch.bfloat16 for t in moments)
    n_params = len(bf16.state)
    step_bytes = 4 * n_params  # one fp32 scalar `step` per param in both optimizers
    assert optimizer_state_bytes(fp32) - step_bytes == 2 * (optimizer_state_bytes(bf16) - step_bytes)
    assert optimizer_state_devices(bf16) == {"cpu"}


def test_bf16_state_dict_round_trip(fresh_model, batches):
    model = fresh_model()
    optimizer = adamw(model, "auto", "bf16")
    train(model, optimizer, batches[:3])
    saved_model, saved_optim = copy.deepcopy(model.state_dict()), round_trip(optimizer.state_dict())
    train(model, optimizer, batches[3:5])

    resumed = fresh_model()
    resumed.load_state_dict(saved_model)
    resumed_optim = adamw(resumed, "auto", "bf16")
    resumed_optim.load_state_dict(saved_optim)
    # Optimizer.load_state_dict casts state to the param dtype; ours keeps the moments in bf16.
    assert all(s["exp_avg_sq"].dtype == torch.bfloat16 for s in resumed_optim.state.values())
    train(resumed, resumed_optim, batches[3:5])
    assert_same_params(resumed, model)


# --- optimizer step in backward --------------------------------------------------------------

@pytest.mark.parametrize("implementation", ["for-loop", "fused"])
def test_in_backward_equals_adamw(fresh_model, batches, implementation):
    """Per-parameter AdamW is elementwise the same math as one AdamW over all params: bitwise."""
    reference, model = fresh_model(), fresh_model()
    train(reference, adamw(reference, implementation), batches[:5])
    optimizer = in_backward(model, implementation)
    train_in_backward(model, optimizer, batches[:5])
    assert_same_params(model, reference)
    assert all(p.grad is None for p in model.parameters())


def test_in_backward_with_grad_accumulation(fresh_model, batches):
    reference, model = fresh_model(), fresh_model()
    train_accumulating(reference, adamw(reference), batches[:10], accum=2)
    optimizer = in_backward(model)
    train_in_backward(model, optimizer, batches[:10], accum=2)
    assert_same_params(model, reference)
    assert all(p.grad is None for p in model.parameters())
    # 5 optimizer steps were taken, not 10.
    assert all(s["step"].item() == 5 for s in optimizer.state.values())


def count_live_grads(model):
    """Hooks that record the peak number of params holding a .grad, checked as each grad lands.
    Registered before the optimizer's hooks, so each count includes the grad just accumulated."""
    params = list(model.parameters())
    peak = [0]

    def hook(_param):
        peak[0] = max(peak[0], sum(p.grad is not None for p in params))

    handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
    return peak, handles


def test_in_backward_never_holds_all_grads(fresh_model, batches):
    standard = fresh_model()
    peak_standard, _ = count_live_grads(standard)
    train(standard, adamw(standard), batches[:1])

    model = fresh_model()
    peak, _ = count_live_grads(model)
    optimizer = in_backward(model)
    loss = loss_of(model, batches[0])
    loss.backward()
    n_params = len(list(model.parameters()))
    assert peak_standard[0] == n_params
    assert peak[0] == 1  # each grad is stepped on and freed before the next one lands
    # The grad norm is still available for logging, and matches the standard one.
    reference = fresh_model()
    loss_of(reference, batches[0]).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    torch.testing.assert_close(optimizer.take_grad_norm(), expected)

    optimizer.detach()  # no hooks: backward leaves the grads alone
    loss_of(model, batches[1]).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_in_backward_set_lr_and_state_dict_round_trip(fresh_model, batches):
    model = fresh_model()
    optimizer = in_backward(model)
    lrs = [LR * (i + 1) / 5 for i in range(5)]  # a warmup, set by the trainer each step
    for lr, batch in zip(lrs[:3], batches[:3]):
        optimizer.set_lr(lr)
        loss_of(model, batch).backward()
    saved_model, saved_optim = copy.deepcopy(model.state_dict()), round_trip(optimizer.state_dict())
    assert set(saved_optim) == {name for name, _ in model.named_parameters()}
    for lr, batch in zip(lrs[3:], batches[3:5]):
        optimizer.set_lr(lr)
        loss_of(model, batch).backward()

    resumed = fresh_model()
    resumed.load_state_dict(saved_model)
    resumed_optim = in_backward(resumed)
    resumed_optim.load_state_dict(saved_optim)
    for lr, batch in zip(lrs[3:], batches[3:5]):
        resumed_optim.set_lr(lr)
        loss_of(resumed, batch).backward()
    assert_same_params(resumed, model)

    # The same lrs through a plain AdamW give the same weights: set_lr reaches every param.
    reference = fresh_model()
    reference_optim = adamw(reference)
    for lr, batch in zip(lrs, batches[:5]):
        for group in reference_optim.param_groups:
            group["lr"] = lr
        train(reference, reference_optim, [batch])
    assert_same_params(reference, model)


def test_in_backward_refuses_clipping(initial_model):
    with pytest.raises(UserError, match="optim.grad_clip=0 with optim.in_backward"):
        in_backward(initial_model, grad_clip=1.0)


# --- CPU offload -----------------------------------------------------------------------------

def offload(model, **kwargs):
    return CPUOffloadOptimizer(param_groups(model, WD), LR, BETAS, EPS, WD, **kwargs)


def warmup_schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))


def test_cpu_offload_equals_adamw_with_scheduler(fresh_model, batches):
    reference, model = fresh_model(), fresh_model()
    reference_optim = adamw(reference)
    train(reference, reference_optim, batches[:5], warmup_schedule(reference_optim))
    optimizer = offload(model)
    train(model, optimizer, batches[:5], warmup_schedule(optimizer))
    # The same fused CPU AdamW on an fp32 copy of the same weights: bitwise equal.
    assert_same_params(model, reference)
    assert optimizer.inner.param_groups[0]["lr"] == reference_optim.param_groups[0]["lr"]

    # The state is the CPU optimizer's: distinct tensors from the params, all on the CPU.
    params = {p.data_ptr() for p in model.parameters()}
    inner_state = [t for s in optimizer.inner.state.values() for t in s.values()]
    assert inner_state and all(t.device.type == "cpu" and t.data_ptr() not in params for t in inner_state)
    masters = [m for g in optimizer.inner.param_groups for m in g["params"]]
    assert all(m.dtype == torch.float32 and m.data_ptr() not in params for m in masters)
    # optimizer.state maps the device params to those same CPU dicts: no device state of its own.
    assert set(optimizer.state) == set(model.parameters())
    device_params = [p for g in optimizer.param_groups for p in g["params"]]
    assert all(optimizer.state[p] is optimizer.inner.state[m] for p, m in zip(device_params, masters))
    assert optimizer_state_devices(optimizer) == {"cpu"}
    assert optimizer_state_bytes(optimizer) == optimizer_state_bytes(reference_optim)


def test_cpu_offload_state_dict_round_trip(fresh_model, batches):
    model = fresh_model()
    optimizer = offload(model)
    scheduler = warmup_schedule(optimizer)
    train(model, optimizer, batches[:3], scheduler)
    saved_model, saved_optim = copy.deepcopy(model.state_dict()), round_trip(optimizer.state_dict())
    saved_scheduler = scheduler.state_dict()
    train(model, optimizer, batches[3:5], scheduler)

    # In the trainer's order: the scheduler exists (and has set lr) before the state is loaded.
    resumed = fresh_model()
    resumed.load_state_dict(saved_model)
    resumed_optim = offload(resumed)
    resumed_scheduler = warmup_schedule(resumed_optim)
    resumed_optim.load_state_dict(saved_optim)
    resumed_scheduler.load_state_dict(saved_scheduler)
    train(resumed, resumed_optim, batches[3:5], resumed_scheduler)
    assert_same_params(resumed, model)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_cpu_offload_dcp_checkpoint_round_trip(fresh_model, batches, tmp_path):
    """Through torch.distributed.checkpoint, as the checkpoint manager saves. get_state_dict
    runs a zero-lr step on an optimizer with empty .state; saving must not disturb training."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = fresh_model()
    optimizer = offload(model, state_dtype="bf16")  # offload and bf16 state combine
    train(model, optimizer, batches[:3])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path))
    train(model, optimizer, batches[3:5])

    resumed = fresh_model()
    resumed_optim = offload(resumed, state_dtype="bf16")
    model_sd, optim_sd = get_state_dict(resumed, resumed_optim)
    payload = {"model": model_sd, "optim": optim_sd}
    dcp.load(payload, checkpoint_id=str(tmp_path))
    set_state_dict(resumed, resumed_optim, model_state_dict=payload["model"], optim_state_dict=payload["optim"])
    assert all(s["exp_avg"].dtype == torch.bfloat16 and s["step"].item() == 3 for s in resumed_optim.state.values())
    train(resumed, resumed_optim, batches[3:5])
    assert_same_params(resumed, model)
