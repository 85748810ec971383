"""The Jupyter front: set up a backend, submit, watch and steer an experiment from a notebook.

The control notebook (``notebooks/ExploringBatchAI.ipynb``) calls the same helpers the 2018
deep_bait notebook did — :func:`setup_cluster`, :func:`submit_all`, :func:`print_jobs_summary`,
:func:`wait_for_job`, :func:`download_files` — but in JupyterLab they are live ipywidgets: a form
for the backend, a progress bar, a jobs table that refreshes itself until every run is final (with
cancel buttons and links to the executed notebooks), and a log that tails a run as it executes.

Everywhere else (a plain ``python`` process, papermill executing the control notebook in CI) the
same calls print plain text, like deep_bait's helpers did. :func:`display_mode` decides which.

The state lives in small pure classes (:class:`Cluster`, :class:`SubmissionModel`,
:class:`JobsSummaryModel`, :class:`SummaryRefresher`) that render HTML (through the Jinja2
templates ``results/templates/widget_*.html.j2``) or text and need no browser; the widget code only
wraps them. ``ipywidgets`` (the ``widgets`` extra) is imported only when a widget is built, so
``import nbbatch`` and ``import nbbatch.widgets`` stay light.

One module per concern: :mod:`~nbbatch.ui.widgets.display` (widgets or text, shared formatting),
:mod:`~nbbatch.ui.widgets.links` (executed notebooks), :mod:`~nbbatch.ui.widgets.cluster` (the
backend form), :mod:`~nbbatch.ui.widgets.submission`, :mod:`~nbbatch.ui.widgets.jobs` (the jobs
table), :mod:`~nbbatch.ui.widgets.pipelines` (a pipeline's stages) and :mod:`~nbbatch.ui.widgets.logs` (a run's
log, cancelling).
"""

from nbbatch.results.render import status_css
from nbbatch.ui.widgets.cluster import Cluster, ClusterForm, compute_html, setup_cluster
from nbbatch.ui.widgets.display import display_mode, format_duration
from nbbatch.ui.widgets.jobs import JobsSummary, JobsSummaryModel, SummaryRefresher, print_jobs_summary
from nbbatch.ui.widgets.links import NotebookLinks, download_files, notebook_links, open_notebook, server_urls
from nbbatch.ui.widgets.logs import JobLog, wait_for_job
from nbbatch.ui.widgets.pipelines import PipelineSummary, print_pipeline_summary
from nbbatch.ui.widgets.submission import SHARED_PARAMETERS, Submission, SubmissionModel, cancel_all, cancel_job, submit_all

__all__ = [
    "Cluster", "ClusterForm", "compute_html", "setup_cluster",
    "SHARED_PARAMETERS", "SubmissionModel", "Submission", "submit_all",
    "JobsSummaryModel", "SummaryRefresher", "JobsSummary", "print_jobs_summary", "PipelineSummary",
    "print_pipeline_summary",
    "JobLog", "wait_for_job", "cancel_job", "cancel_all",
    "NotebookLinks", "notebook_links", "server_urls", "open_notebook", "download_files",
    "display_mode", "format_duration", "status_css",
]
