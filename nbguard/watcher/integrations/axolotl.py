"""An axolotl plugin that puts the full NaN/Inf watch on the Trainer axolotl builds, from its YAML config::

    plugins:
      - nbguard.watcher.integrations.axolotl.NbguardPlugin
    nbguard_policy: skip          # warn (default), skip, stop or rewind
    nbguard_rewind_every: 50      # rewind's snapshot interval, in optimizer steps

axolotl imports the class by that path and calls its hooks. ``post_trainer_create`` is handed the Trainer
before ``train()``: the watch is the one ``nbguard.watch(trainer, log_to=None, verify=False)`` attaches
(same policies, same events), built here from the watcher itself, which sits below the API's trackers and
verifier; its events are in ``nbguard.report()`` and on the plugin
(``PluginManager.get_instance().plugins[PLUGIN_PATH].watch``); ``nbguard.verify(event)`` verifies one after.
The class subclasses axolotl's ``BasePlugin`` and is made on first access (module ``__getattr__``), so
this module imports without axolotl.
"""
from __future__ import annotations

from typing import Any

from ...document.outward import exception_line, warn
from ..core.watch import NanWatch
from ..policy.policies import check_policy
from ..policy.rewind import RewindSettings

PLUGIN_PATH = f"{__name__}.NbguardPlugin"
ARGS_PATH = f"{__package__}.axolotl_args.NbguardArgs"


def watch_options(cfg: Any) -> dict[str, Any]:
    """The watch's options from the plugin's keys of an axolotl config; a wrong policy is refused here, when
    axolotl loads the config, not after the model is loaded."""
    policy = check_policy(cfg.get("nbguard_policy") or "warn")
    every = cfg.get("nbguard_rewind_every")
    return {
        "policy": policy,
        "rewind": RewindSettings(every=every) if every is not None else None,
    }


class WatchHooks:
    """The plugin's hooks, apart from axolotl's ``BasePlugin`` (the class axolotl loads joins the two)."""

    watch: Any = None

    def get_input_args(self) -> str:
        return ARGS_PATH

    def register(self, cfg: Any) -> None:
        watch_options(cfg)

    def post_trainer_create(self, cfg: Any, trainer: Any) -> None:
        try:
            self.watch = NanWatch(trainer, **watch_options(cfg)).attach()
        except Exception as exc:  # never the user's run's failure: it trains on, unwatched, and is told so
            warn(f"nbguard's axolotl plugin could not attach its watch ({exception_line(exc)}); this run trains "
                 "unwatched", RuntimeWarning)


def __getattr__(name: str) -> Any:
    if name != "NbguardPlugin":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from axolotl.integrations.base import BasePlugin  # local: only axolotl asks for the class, where it is installed

    plugin = type("NbguardPlugin", (WatchHooks, BasePlugin), {"__module__": __name__, "__doc__": WatchHooks.__doc__})
    globals()[name] = plugin
    return plugin
