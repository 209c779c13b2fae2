"""The NaN/Inf watch: a one-read-per-step sentinel, replay localisation, guard policies."""
from .config import WatchConfig
from .context import WatchContext
from .detectors import WatchSettings
from .history import ActivationHistory, GradHistory, group_name
from .pipeline import Detector, StepView, WatchComponent
from .policies import POLICIES
from .registry import register_component
from .rewind import RewindSettings
from .watch import NanWatch

__all__ = ["ActivationHistory", "Detector", "GradHistory", "NanWatch", "POLICIES", "RewindSettings", "StepView",
           "WatchComponent", "WatchConfig", "WatchContext", "WatchSettings", "group_name", "register_component"]
