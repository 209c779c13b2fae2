"""%config NbguardMagics.*: the magics' defaults, set as any IPython magic's configuration is."""
from __future__ import annotations

from notebook_helpers import run, shell  # noqa: F401

SETUP = """
import torch
from nbguard.testing import tiny_llama
my_model = tiny_llama()
my_opt = torch.optim.SGD(my_model.parameters(), lr=0.1)
"""


def test_config_sets_the_default_policy_verify_and_dashboard(shell):  # noqa: F811
    run(shell, SETUP)
    assert run(shell, '%config NbguardMagics.default_policy = "skip"').error is None
    run(shell, "%config NbguardMagics.verify_fixes = False")
    run(shell, "%config NbguardMagics.dashboard_activations = True")
    run(shell, "%nanwatch my_model")
    state = shell.user_ns  # the watch the magic started is the one attached to the model
    from nbguard.watcher.core.watch import attached_watch

    watch = attached_watch(state["my_model"])
    assert watch.policy == "skip" and watch.activation_history is not None and watch._verifier is None
    run(shell, "%nanwatch off")
    run(shell, "%nanwatch my_model --policy stop")  # the magic's own option wins
    assert attached_watch(state["my_model"]).policy == "stop"
    run(shell, "%nanwatch off")
    # the shell keeps its config across reloads (as IPython does): put the defaults back
    for line in ('default_policy = "warn"', "verify_fixes = True", "dashboard_activations = False"):
        run(shell, f"%config NbguardMagics.{line}")


def test_config_refuses_an_unknown_policy_and_documents_itself(shell):  # noqa: F811
    magics = shell.magics_manager.registry["NbguardMagics"]
    before = magics.default_policy
    run(shell, '%config NbguardMagics.default_policy = "ignore"')  # IPython logs the TraitError
    assert magics.default_policy == before
    assert [type(c).__name__ for c in shell.configurables].count("NbguardMagics") == 1
    assert "default_policy" in run(shell, "%config NbguardMagics").stdout
    assert "NbguardMagics.default_policy" in magics.nanwatch.__doc__


def test_a_refused_config_value_never_breaks_the_next_load(shell):  # noqa: F811
    # IPython keeps a value %config refused in shell.config: the next %load_ext must still work
    run(shell, '%config NbguardMagics.default_policy = "ignore"')
    run(shell, "%unload_ext nbguard")
    import pytest

    with pytest.warns(RuntimeWarning, match="ignoring c.NbguardMagics.default_policy = 'ignore'"):
        assert run(shell, "%load_ext nbguard").error is None
    assert shell.magics_manager.registry["NbguardMagics"].default_policy == "warn"
    assert "default_policy" not in shell.config.NbguardMagics
