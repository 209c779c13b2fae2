"""The NaN/Inf watch: a one-read-per-step sentinel, replay localisation, guard policies."""
from .detectors import WatchSettings
from .history import ActivationHistory, GradHistory, group_name
from .pipeline import Detector, StepView
from .policies import POLICIES
from .rewind import RewindSettings
from .watch import NanWatch

__all__ = ["ActivationHistory", "Detector", "GradHistory", "NanWatch", "POLICIES", "RewindSettings", "StepView",
           "WatchSettings", "group_name"]
