"""`nmt serve`: the served models behind a JSON API (FastAPI on uvicorn, the optional extra
``serve``), with dynamic batching, per-request limits, and a page at ``/`` to try them.

command.py (``ServeRequest``, ``serve_command``), models.py (``ServedModel``: a loaded model
and what GET /api/models says of it), limits.py, schemas.py (the JSON in and out),
batching.py (the queue, its groups, the one decode thread), jobs.py (requests checked and
decoded with the commands' own functions), app.py (``create_app``: routes, errors, the body
limit), page/ (the page). Only app.py and command.py's body import FastAPI and uvicorn.
"""
