"""Presenting replay results to an operator: a terminal table, JSON, and a self-contained HTML timeline."""

from fsm_pd.report.html import render_html
from fsm_pd.report.table import render_table, to_json

__all__ = ["render_html", "render_table", "to_json"]
