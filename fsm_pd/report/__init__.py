"""Presenting replay results to an operator: a terminal table, JSON, a self-contained HTML timeline, a request's
attempts; each written room by room as the replay streams."""

from fsm_pd.report.html import HtmlWriter
from fsm_pd.report.request import render_request, request_json
from fsm_pd.report.table import JsonWriter, TableWriter, print_timeline, to_json

__all__ = ["HtmlWriter", "JsonWriter", "TableWriter", "print_timeline", "render_request", "request_json", "to_json"]
