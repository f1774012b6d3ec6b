"""The control panel (labkit.panel): an application on top of run/ (it starts launches in threads, Stop ends them)
and view/ (it draws their figures and bars). Knobs for RunConfig fields (controls.py), the past runs to tick
(table.py), the panel itself (panel.py)."""
