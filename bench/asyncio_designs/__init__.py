"""The asyncio designs greenserve is compared with: FastAPI + uvicorn around greenserve's own decode and model.

    app.py     the three designs (naive, executor, locked) as one FastAPI app factory
    server.py  start/stop ``uvicorn`` on 127.0.0.1 as a subprocess, like ``harness.launch`` does for gunicorn
"""
