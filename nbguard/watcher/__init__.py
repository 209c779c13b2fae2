"""The NaN/Inf watch: a one-read-per-step sentinel, replay localisation, guard policies."""
from .core.config import WatchConfig
from .core.context import WatchContext
from .core.pipeline import Detector, StepView, WatchComponent
from .core.registry import register_component
from .core.watch import NanWatch
from .detectors.thresholds import WatchSettings
from .policy.policies import POLICIES
from .policy.rewind import RewindSettings
from .reads.history import ActivationHistory, GradHistory, group_name

__all__ = ["ActivationHistory", "Detector", "GradHistory", "NanWatch", "POLICIES", "RewindSettings", "StepView",
           "WatchComponent", "WatchConfig", "WatchContext", "WatchSettings", "group_name", "register_component"]
