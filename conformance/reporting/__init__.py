"""Reporting: a ``RunResult`` as text, JSON, Markdown, HTML and pictures; one renderer a format.

===============  ===============================================================================
``textwidth``    text within a width (``--width``, 100 columns by default): wrapped lines,
                 table panels, reproducers broken where Python allows
``sections``     the sections every format shares: a cell's text, a failure step by step, the
                 known differences, bad inputs, property checks, missing packages, the summary
``shrink``       the smallest failing case of a failing cell, as a runnable script
``groups``       the failing cells grouped by bug, and a wrong layout found by rerunning
``overview``     the terminal's page (a summary per column, the matrix one glyph per dtype,
                 each known difference once) and ``--verbose``'s full report
``focused``      the terminal's report of a checked module (bugs first, compact table)
``terminal``     the terminal report (``text``): chooses the page, the full or the focused view
``json_report``  ``--json FILE``
``markdown``     ``--markdown FILE``
``plots``        ``--plot DIR``: heatmaps and error-vs-dtype plots (matplotlib)
``html/``        ``--html FILE``: one self-contained page to explore a run (the grid, filters,
                 each cell's steps, known differences, reproducers)
===============  ===============================================================================
"""
