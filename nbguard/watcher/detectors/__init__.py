"""The built-in detectors and checks that judge a step (the thresholds in ``thresholds.py``)."""
