"""Drivers: the one owner of a submission, from the experiment's lock to its report.

Every driver has the same shape (:class:`~nbbatch.drivers.base.Driver`): hold the experiment's lock and lease,
bring its records up to date, :meth:`~nbbatch.drivers.base.Driver.run` (start the runs, write the manifest, wait
as asked), and report the records as a :class:`~nbbatch.drivers.base.SubmitResult`. What differs is ``run``:

* :class:`~nbbatch.drivers.submission.SubmissionDriver`: a planned batch, started once;
* :class:`~nbbatch.drivers.search.SearchDriver`: a search, whose runs Optuna draws as it goes;
* :class:`~nbbatch.drivers.promoting.PromotingSearchDriver`: a search whose trials pause at rungs and continue from
  their checkpoints;
* :class:`~nbbatch.drivers.pbt.PbtSearchDriver`: population-based training, whose worse members continue from the
  better members' checkpoints with perturbed parameters (:func:`~nbbatch.drivers.promoting.search_driver` picks one
  of the three search drivers).

:func:`nbbatch.api.submit` picks one for the experiment and hands it the plan, backend and share.
"""

from nbbatch.drivers.base import Driver, SubmitResult
from nbbatch.drivers.pbt import PbtSearchDriver
from nbbatch.drivers.promoting import PromotingSearchDriver, search_driver
from nbbatch.drivers.search import SearchDriver
from nbbatch.drivers.submission import SubmissionDriver

__all__ = ["Driver", "PbtSearchDriver", "PromotingSearchDriver", "SearchDriver", "SubmissionDriver", "SubmitResult",
           "search_driver"]
