"""The comparison report of a study: load runs from MLflow, compute IQMs and CIs, render.

- :mod:`core.report.data`: the study's runs read from MLflow, grouped into arms.
- :mod:`core.report.stats`: IQM, bootstrap intervals, probability of improvement.
- :mod:`core.report.render`: markdown, HTML and figures.
- :mod:`core.report.study`: the analysis and the ``python -m core.report`` command.
- :mod:`core.report.results`: the results document of ``python -m core.study``.
- :mod:`core.report.evidence`: what a study's scores can show (calibration, intent to
  treat, targets judged with intervals and controls, the aggregate over tasks).
- :mod:`core.report.contribution`: what an arm's LLM put into its runs.
- :mod:`core.report.archive`: a study's counted runs kept beside its report (``runs.jsonl.gz``).
"""

from core.report.study import ArmResult, TaskResult, analyze, main, write_report

__all__ = ["ArmResult", "TaskResult", "analyze", "main", "write_report"]
