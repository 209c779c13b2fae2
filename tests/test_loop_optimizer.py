"""Plain loops (nanoGPT-style: a model, AdamW, maybe clip_grad_norm_) get loop cells and their classic failures:
Adam's eps against float16 weights, updates that round away, and a skip policy that cannot save inf weights."""
from __future__ import annotations

import pytest
import torch
from notebook_helpers import run, shell, usage_line  # noqa: F401

import nbguard
import nbguard.fixes
from nbguard.session import SESSION
from nbguard.testing import plant_fp16_overflow_token, tiny_llama

OVERFLOW_TOKEN = 7


def _loop(model, optimizer, steps, *, clip=None, autocast=None, bad_step=None, seed=0):
    """A nanoGPT-style hand loop: forward, backward, optional clip, step. Returns the losses."""
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        ids = torch.randint(OVERFLOW_TOKEN + 1, model.config.vocab_size, (2, 16), generator=gen)
        if step == bad_step:
            ids[0, 3] = OVERFLOW_TOKEN
        if autocast is not None:
            with torch.autocast("cpu", dtype=autocast):
                loss = model(input_ids=ids, labels=ids).loss
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _nonfinite(model) -> int:
    return sum(int((~torch.isfinite(p)).sum()) for p in model.parameters())


@pytest.fixture(autouse=True)
def _fresh_session():
    SESSION.clear()
    yield
    SESSION.clear()


# -- the watch: loop cells, and no clipping offered to a loop that clips ------------------------------
def _watched_overflow(clip=None):
    """fp16 autocast overflows in q_proj on one token (the real mechanism), under the loop's own names."""
    torch.manual_seed(0)
    net = tiny_llama()
    plant_fp16_overflow_token(net, OVERFLOW_TOKEN)
    opt_gpt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    SESSION.names = {"model": "net", "optimizer": "opt_gpt"}  # what %nanwatch net --optimizer opt_gpt sets
    with nbguard.watch(net, optimizer=opt_gpt, policy="skip") as watch:
        _loop(net, opt_gpt, 3, clip=clip, autocast=torch.float16, bad_step=1)
    assert [e.cause for e in watch.events if e.kind == "nonfinite-loss"] == ["overflow"]
    return net, opt_gpt, {v.fix: v for v in watch.verification.verdicts}


def test_a_plain_loop_gets_loop_cells_in_its_own_names():
    net, opt_gpt, verdicts = _watched_overflow()
    assert {"switch-precision", "enable-grad-clipping", "lower-learning-rate"} <= set(verdicts)
    for fix_id, verdict in verdicts.items():
        assert verdict.code is not None, fix_id
        assert "args." not in verdict.code and "trainer." not in verdict.code, (fix_id, verdict.code)
    for fix_id in ("enable-grad-clipping", "lower-learning-rate", "switch-precision"):
        assert "opt_gpt." in verdicts[fix_id].code, fix_id
    # the switch's verdict and its cell say the same thing about the loop's autocast
    switch = verdicts["switch-precision"]
    assert switch.changes.get("autocast") == "float16 -> bfloat16"
    assert "torch.autocast(device_type, dtype=torch.bfloat16)" in switch.code


def test_the_loop_clip_cell_clips_every_step_and_runs_twice_without_stacking():
    net, opt_gpt, verdicts = _watched_overflow()
    code = verdicts["enable-grad-clipping"].code
    for _ in range(2):
        exec(code, {"net": net, "opt_gpt": opt_gpt})
    assert len(opt_gpt._optimizer_step_pre_hooks) == 1
    for p in net.parameters():
        p.grad = torch.full_like(p, 10.0)
    before = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in net.parameters()]))
    lr = opt_gpt.param_groups[0]["lr"]
    opt_gpt.param_groups[0]["lr"] = 0.0
    opt_gpt.step()
    opt_gpt.param_groups[0]["lr"] = lr
    after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in net.parameters()]))
    assert before > 100 and after == pytest.approx(1.0, rel=1e-3)
    # the action and the cell agree: applying it now changes nothing
    assert nbguard.fixes.apply("enable-grad-clipping", model=net, optimizer=opt_gpt).changed == {}


def test_the_loop_lr_cell_and_switch_cell_change_what_they_say():
    net, opt_gpt, verdicts = _watched_overflow()
    exec(verdicts["lower-learning-rate"].code, {"net": net, "opt_gpt": opt_gpt})
    assert opt_gpt.param_groups[0]["lr"] == pytest.approx(1e-4)

    half = tiny_llama(dtype=torch.float16)  # a loop that trained fp16 weights: the moments are fp16 too
    half_opt = torch.optim.AdamW(half.parameters(), lr=1e-4, eps=1e-3)
    _loop(half, half_opt, 1)
    assert {s["exp_avg"].dtype for s in half_opt.state.values()} == {torch.float16}
    exec(verdicts["switch-precision"].code, {"net": half, "opt_gpt": half_opt})
    assert {p.dtype for p in half.parameters()} == {torch.float32}
    assert {s["exp_avg"].dtype for s in half_opt.state.values()} == {torch.float32}
    _loop(half, half_opt, 1)  # the next step runs with the moved moments


def test_no_clipping_fix_for_a_loop_that_already_clips_at_one():
    _, _, verdicts = _watched_overflow(clip=1.0)
    assert "enable-grad-clipping" not in verdicts
    assert "switch-precision" in verdicts  # the rest is still offered


def test_a_loop_clipping_above_one_is_still_offered_clipping():
    _, _, verdicts = _watched_overflow(clip=50.0)
    assert "enable-grad-clipping" in verdicts


# -- the audit: Adam's eps against float16 weights ------------------------------------------------------
def test_fp16_weights_under_adamw_eps_1e8_report_the_eps_rule_and_really_blow_up():
    torch.manual_seed(0)
    model = tiny_llama(dtype=torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-8)
    result = nbguard.audit(model, optimizer=opt)
    [finding] = [f for f in result.findings if f.rule == "adam-eps-underflow"]
    assert finding.severity == "error"
    assert finding.evidence["eps"] == 1e-8 and finding.evidence["eps_in_weight_dtype"] == 0.0
    assert finding.evidence["smallest_normal"] == torch.finfo(torch.float16).tiny
    assert finding.evidence["implementation"] == "for-loop"
    assert finding.fixes[:2] == ["optimizer-eps-for-dtype", "upcast-trainable-fp32"]
    # what the rule predicts happens: one step makes weights inf
    twin = tiny_llama(dtype=torch.float16)
    _loop(twin, torch.optim.AdamW(twin.parameters(), lr=1e-3, eps=1e-8), 1)
    assert _nonfinite(twin) > 0


def test_the_eps_fix_cell_makes_the_finding_go_and_the_run_stay_finite():
    model = tiny_llama(dtype=torch.float16)
    my_adam = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-8)
    result = nbguard.audit(model, optimizer=my_adam)
    cell = result.to_document(names={"model": "model", "optimizer": "my_adam"})["fix_cells"]["optimizer-eps-for-dtype"]
    assert "my_adam.param_groups" in cell["code"] and "args." not in cell["code"]
    exec(cell["code"], {"my_adam": my_adam, "model": model})
    assert my_adam.param_groups[0]["eps"] == pytest.approx(1e-4)
    assert "adam-eps-underflow" not in {f.rule for f in nbguard.audit(model, optimizer=my_adam).findings}
    _loop(model, my_adam, 6)
    assert _nonfinite(model) == 0


def test_the_fp32_master_weights_cell_also_makes_the_finding_go():
    model = tiny_llama(dtype=torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-8)
    code = nbguard.fixes.code("upcast-trainable-fp32", model="model")
    exec(code, {"model": model})
    assert "adam-eps-underflow" not in {f.rule for f in nbguard.audit(model, optimizer=opt).findings}


@pytest.mark.parametrize("dtype, eps", [(torch.float32, 1e-8), (torch.float16, 1e-4),
                                        (torch.float16, torch.finfo(torch.float16).tiny), (torch.bfloat16, 1e-8)])
def test_healthy_twins_stay_quiet(dtype, eps):
    model = tiny_llama(dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps)
    assert "adam-eps-underflow" not in {f.rule for f in nbguard.audit(model, optimizer=opt).findings}


def test_fused_adamw_is_a_warning_that_says_the_kernel_computes_in_fp32():
    model = tiny_llama(dtype=torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-8, fused=True)
    [finding] = [f for f in nbguard.audit(model, optimizer=opt).findings if f.rule == "adam-eps-underflow"]
    assert finding.severity == "warning" and finding.evidence["implementation"] == "fused"
    assert "float32" in finding.detail


def test_updates_that_round_away_in_bf16_are_reported_and_really_round_away():
    torch.manual_seed(0)
    model = tiny_llama(dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    [finding] = [f for f in nbguard.audit(model, optimizer=opt).findings if f.rule == "half-updates-round-away"]
    share = finding.evidence["share_of_weights_unchanged"]
    assert finding.evidence["lr"] == 1e-5 and finding.evidence["ulp_at_median"] > 2 * 1e-5 and share > 0.5
    before = [p.detach().clone() for p in model.parameters()]
    _loop(model, opt, 1)
    same = sum(int((a == b).sum()) for a, b in zip(before, model.parameters())) / sum(p.numel() for p in before)
    assert same > 0.5  # most weights did not move at all
    for quiet in (tiny_llama(dtype=torch.float32), tiny_llama(dtype=torch.bfloat16)):
        lr = 1e-5 if quiet.dtype == torch.float32 else 1e-2
        rules = {f.rule for f in nbguard.audit(quiet, optimizer=torch.optim.AdamW(quiet.parameters(), lr=lr)).findings}
        assert "half-updates-round-away" not in rules


def test_bad_optimizer_input_is_a_clear_error():
    model = tiny_llama()
    with pytest.raises(TypeError, match=r"optimizer= must be a torch optimizer .*got str"):
        nbguard.audit(model, optimizer="adamw")
    with pytest.raises(TypeError, match=r"scaler= must be a torch.amp.GradScaler; got int"):
        nbguard.audit(model, scaler=3)
    with pytest.raises(ValueError, match=r"needs optimizer="):
        nbguard.fixes.apply("optimizer-eps-for-dtype", model=model)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"eps must be a positive number"):
        nbguard.fixes.apply("optimizer-eps-for-dtype", optimizer=opt, eps=-1)
    with pytest.raises(ValueError, match=r"changes the optimizer: pass optimizer="):
        nbguard.fixes.code("optimizer-eps-for-dtype", model="model")


# -- %precision_check model optimizer ------------------------------------------------------------------------
def test_precision_check_takes_the_loop_optimizer(shell):
    run(shell, "import torch\nfrom nbguard.testing import tiny_llama\n"
               "net = tiny_llama(dtype=torch.float16)\nopt = torch.optim.AdamW(net.parameters(), lr=1e-3, eps=1e-8)")
    cell = run(shell, "%precision_check net opt")
    assert cell.error is None, cell.stderr
    [doc] = cell.docs
    assert "adam-eps-underflow" in {f["rule"] for f in doc["findings"]}
    code = doc["fix_cells"]["optimizer-eps-for-dtype"]["code"]
    assert "opt.param_groups" in code and "args." not in code
    run(shell, code)
    [doc] = run(shell, "%precision_check net opt").docs
    assert "adam-eps-underflow" not in {f["rule"] for f in doc["findings"]}


def test_precision_check_optimizer_errors_are_one_line(shell):
    run(shell, "import torch\nfrom nbguard.testing import tiny_llama\nnet = tiny_llama()\nother = tiny_llama()\n"
               "opt = torch.optim.AdamW(other.parameters())\nnumbers = [1]")
    assert "updates none of the parameters of 'net'" in usage_line(run(shell, "%precision_check net opt"))
    assert "'numbers' is a list" in usage_line(run(shell, "%precision_check net numbers"))


# -- policy skip with weights that are already inf ---------------------------------------------------------
def test_skip_with_inf_weights_says_once_that_skipping_cannot_save_the_run():
    torch.manual_seed(0)
    model = tiny_llama(dtype=torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-8)
    with nbguard.watch(model, optimizer=opt, policy="skip", verify=False) as watch:
        _loop(model, opt, 8)
    assert _nonfinite(model) > 0
    [event] = [e for e in watch.events if e.kind == "skip-cannot-save"]
    assert "skipping cannot save this run" in event.message and "rewind" in event.message
    assert event.evidence["fixes"][0] == "optimizer-eps-for-dtype"
    assert event.evidence["nonfinite_parameters"]["count"] > 0


def test_skip_that_saves_the_run_stays_quiet():
    torch.manual_seed(0)
    net = tiny_llama()  # a one-off fp16 overflow: skipping that step leaves finite weights
    plant_fp16_overflow_token(net, OVERFLOW_TOKEN)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    with nbguard.watch(net, optimizer=opt, policy="skip", verify=False) as watch:
        _loop(net, opt, 4, autocast=torch.float16, bad_step=1)
    assert any(e.kind == "nonfinite-loss" for e in watch.events) and _nonfinite(net) == 0
    assert not [e for e in watch.events if e.kind == "skip-cannot-save"]
    model = tiny_llama(dtype=torch.float16)  # the eps twin: nothing skipped, nothing said
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    with nbguard.watch(model, optimizer=opt, policy="skip", verify=False) as watch:
        _loop(model, opt, 4)
    assert not [e for e in watch.events if e.kind == "skip-cannot-save"]


def test_nanwatch_writes_loop_cells_with_the_notebook_optimizer_name(shell):
    run(shell, "import torch\nfrom nbguard.testing import tiny_llama\nnet = tiny_llama()\n"
               "opt_gpt = torch.optim.AdamW(net.parameters())")
    cell = run(shell, "%nanwatch net --optimizer opt_gpt")
    assert cell.error is None, cell.stderr
    try:
        names = SESSION.fix_names("model")
        assert names["model"] == "net" and names["optimizer"] == "opt_gpt"
        code = nbguard.fixes.code("lower-learning-rate", **names)
        assert "opt_gpt.param_groups" in code and "args." not in code
    finally:
        run(shell, "%nanwatch off")


def test_nbguard_fix_applies_the_loop_clip_cell_the_watch_verified(shell):
    run(shell, "import torch\nfrom nbguard.testing import tiny_llama, plant_fp16_overflow_token\n"
               "torch.manual_seed(0)\nnet = tiny_llama()\nplant_fp16_overflow_token(net, 7)\n"
               "opt_gpt = torch.optim.AdamW(net.parameters(), lr=1e-3)\n"
               "ids = torch.randint(8, net.config.vocab_size, (2, 16))")
    cell = run(shell, "%%nanwatch net --optimizer opt_gpt --policy skip\n"
                      "for step in range(3):\n"
                      "    batch = ids.clone()\n"
                      "    if step == 1:\n"
                      "        batch[0, 3] = 7\n"
                      "    with torch.autocast('cpu', dtype=torch.float16):\n"
                      "        loss = net(input_ids=batch, labels=batch).loss\n"
                      "    loss.backward()\n"
                      "    opt_gpt.step()\n"
                      "    opt_gpt.zero_grad()\n")
    assert cell.error is None, cell.stderr
    # the watch found this cell not enough: --apply refuses it (saying why and what instead) unless forced
    refused = usage_line(run(shell, "%nbguard fix enable-grad-clipping --apply"))
    assert "enable-grad-clipping was not applied: this cell was not enough on the failing step" in refused
    assert len(shell.user_ns["opt_gpt"]._optimizer_step_pre_hooks) == 0
    cell = run(shell, "%nbguard fix enable-grad-clipping --apply --force")
    assert cell.error is None, cell.stderr
    assert "applied enable-grad-clipping" in cell.stdout and "args." not in cell.stdout
    # the cell is the one the watch ran on the failing step (same text, same names): its verdict is shown
    assert "nbguard: enable-grad-clipping not enough on the failing step" in cell.stdout, cell.stdout
    assert getattr(shell.user_ns["opt_gpt"], "_clip_max_norm", None) == 1.0
    assert len(shell.user_ns["opt_gpt"]._optimizer_step_pre_hooks) == 1


def test_a_loop_gradscaler_over_fp16_weights_is_the_unscale_error_and_really_raises():
    model = tiny_llama(dtype=torch.float16)
    opt = torch.optim.AdamW(model.parameters(), eps=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    [finding] = [f for f in nbguard.audit(model, optimizer=opt, scaler=scaler).findings
                 if f.rule == "fp16-unscale-error"]
    assert finding.detail.startswith("Your loop's GradScaler") and finding.fixes == ["upcast-trainable-fp32"]
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    scaler.scale(model(input_ids=ids, labels=ids).loss).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.step(opt)
    quiet = {f.rule for f in nbguard.audit(model, optimizer=opt, scaler=torch.amp.GradScaler("cpu", enabled=False)).findings}
    assert "fp16-unscale-error" not in quiet
    exec(nbguard.fixes.code("upcast-trainable-fp32", model="model"), {"model": model})
    assert "fp16-unscale-error" not in {f.rule for f in nbguard.audit(model, optimizer=opt, scaler=scaler).findings}
