"""``nbbatch.widgets`` is :mod:`nbbatch.ui.widgets`: the Jupyter helpers of the control notebook."""

import sys

from nbbatch.ui import widgets

sys.modules[__name__] = widgets
