"""What a person looks at: the side-by-side figure, any recorded curve, the live view while ranks run, and the
control panel (panel.py: it is handed the launcher; labkit.panel does that).

Reads runs (labkit.records) and draws them; knows nothing of processes or training."""
from .figures import COLORS, compare, curves
from .show import in_notebook, new_figure, show, shown

__all__ = ["COLORS", "compare", "curves", "in_notebook", "new_figure", "show", "shown"]
