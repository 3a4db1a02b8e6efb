"""fastlayers.check in one place: the before/after comparison (run.py), its report (report.py),
the accuracy rule it applies (numerics.py), the model folders and inputs of its command line
(models.py) and the command line itself (cli.py, ``python -m fastlayers check``)."""

from .report import CheckReport, LayerCheck, OutputCheck, Timing
from .run import check

__all__ = ["CheckReport", "LayerCheck", "OutputCheck", "Timing", "check"]
