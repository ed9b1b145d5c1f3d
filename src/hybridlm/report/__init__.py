"""Plots and report cards, rendered from a run's metrics.jsonl and record files only (DESIGN habit
15: reports are derived; nothing here measures or trains).

    plot.py      matplotlib on the file-only backend, `save_figure`, `read_metrics`, loss curves
    stats.py     Wilson / bootstrap intervals, reward-curve windows
    doc.py       a document rendered to Markdown and self-contained HTML; numbers for people
    figures.py   the report card's figures
    card.py      `render_report(run_dir, stages)`: report.md, report.html and plots/ of a flow run
"""
