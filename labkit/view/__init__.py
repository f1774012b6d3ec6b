"""What a person looks at, drawing only: the side-by-side figure and any recorded curve (figures.py), the live view
while ranks run (live.py), progress bars (progress.py), showing a figure once in a notebook (show.py), and a run as
text in a terminal (report.py). The control panel that starts runs is an application above run/ (labkit/app/).

Reads runs (labkit.records) and draws them; knows nothing of processes or training."""
from .figures import COLORS, compare, curves
from .show import in_notebook, new_figure, show, shown

__all__ = ["COLORS", "compare", "curves", "in_notebook", "new_figure", "show", "shown"]
