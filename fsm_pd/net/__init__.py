"""HTTP and socket plumbing every server and client shares: raw HTTP/1.1 framing (``http_protocol``), the uvicorn
runner (``http_server``), unix sockets beside TCP (``unix_sockets``) and httpx clients that reach them
(``unix_http``). None of it imports jax, zmq or SQLAlchemy."""
