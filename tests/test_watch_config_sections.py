"""WatchConfig: one section per registered component, the deprecated keywords, and the magics' --config."""
from __future__ import annotations

import pytest
import torch
from notebook_helpers import run, shell  # noqa: F401

import nbguard
from nbguard.watcher.components.run_checks import RunChecks
from nbguard.watcher.components.stall import StallSettings
from nbguard.watcher.core.config import WatchConfig, describe_sections
from nbguard.watcher.core.registry import registered_components


def _watch(**kwargs):
    model = torch.nn.Linear(4, 2)
    return nbguard.watch(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), verify=False, log_to=None,
                         **kwargs)


def test_every_section_is_a_registered_components_settings_with_its_defaults():
    config = WatchConfig()
    with_settings = {name for name, spec in registered_components().items() if spec.settings is not None}
    assert set(config.sections()) == with_settings and {"stall", "run_checks"} <= with_settings
    assert config.section("stall") == StallSettings()
    assert WatchConfig(stall=StallSettings(after_s=5.0)) == WatchConfig(stall={"after_s": 5.0})


@pytest.mark.parametrize(("sections", "says"), [
    ({"stal": {}}, "no section 'stal'; its sections are the watch's components: "),
    ({"stall": {"after": 3}}, "has no field 'after'; StallSettings's fields: after_s"),
    ({"stall": 600}, "takes a StallSettings or a dict of its fields, got int"),
    ({"run_checks": {"enabled": "yes"}}, "run_checks must be True or False"),
])
def test_a_bad_section_names_what_was_wrong(sections, says):
    with pytest.raises(TypeError, match=says.replace("(", r"\(")):
        WatchConfig(**sections)


def test_a_config_that_is_not_one_is_a_clear_error():
    with pytest.raises(TypeError, match="config must be a nbguard.WatchConfig, got dict"):
        _watch(config={"stall": {"after_s": None}})
    with pytest.raises(TypeError, match="unexpected keyword argument 'stall_after'"):
        _watch(stall_after=3)


def test_run_checks_off_by_config_and_by_the_old_keyword():
    quiet = _watch(config=WatchConfig(run_checks={"enabled": False}))
    assert not [d for d in quiet.detectors if isinstance(d, RunChecks)]
    quiet.detach()
    with pytest.warns(DeprecationWarning, match=r"WatchConfig\(run_checks=\{'enabled'"):
        old = _watch(run_checks=False)
    assert not [d for d in old.detectors if isinstance(d, RunChecks)] and old.config == quiet.config
    old.detach()
    default = _watch()
    assert isinstance(default.detectors[-1], RunChecks)  # judged last, after every other component
    default.detach()


def test_assignments_parse_as_python_literals():
    config = WatchConfig.from_assignments(["stall.after_s=None", "run_checks.enabled=False"])
    assert config.section("stall").after_s is None and config.section("run_checks").enabled is False
    assert WatchConfig.from_assignments(["stall.after_s=2.5"]).section("stall").after_s == 2.5
    with pytest.raises(ValueError, match=r"SECTION.FIELD=VALUE \(e.g. stall.after_s=600\), got 'stall=3'"):
        WatchConfig.from_assignments(["stall=3"])


SETUP = """
import torch
my_model = torch.nn.Linear(4, 2)
my_opt = torch.optim.SGD(my_model.parameters(), lr=0.1)
"""


def test_nanwatch_config_option_reaches_the_watch(shell):  # noqa: F811
    run(shell, SETUP)
    assert run(shell, "%nanwatch my_model --config stall.after_s=None --config run_checks.enabled=False").error is None
    from nbguard.watcher.core.watch import attached_watch

    watch = attached_watch(shell.user_ns["my_model"])
    assert watch.config == WatchConfig(stall={"after_s": None}, run_checks={"enabled": False})
    run(shell, "%nanwatch off")
    bad = run(shell, "%nanwatch my_model --config stall.after=3")
    assert "%nanwatch --config: WatchConfig(stall=...) has no field 'after'" in str(bad.error)
    assert attached_watch(shell.user_ns["my_model"]) is None or not attached_watch(shell.user_ns["my_model"]).attached


def test_nbguard_config_lists_every_section_from_the_registry(shell):  # noqa: F811
    result = run(shell, "%nbguard config")
    assert result.error is None
    out = result.stdout
    for line in describe_sections():
        assert f"  {line}" in out
    assert "stall: after_s=120.0" in out and "run_checks: enabled=True" in out
