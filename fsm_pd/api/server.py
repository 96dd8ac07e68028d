"""The HTTP layer serves its apps with the shared uvicorn runner (``fsm_pd.net.http_server``)."""

from fsm_pd.net.http_server import AppServer, serve

__all__ = ["AppServer", "serve"]
