"""ipywidgets views (API common to ipywidgets 7.7 and 8): finding cards, fix rows, the watch dashboard.

Importing this package imports ipywidgets; callers check :func:`nbguard.notebook.present.widgets_available` first.
"""
