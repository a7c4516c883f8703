"""``omni-accel serve``: an OpenAI-compatible image API over an accelerated pipeline (see docs/serving.md).

    omni-accel serve                                  # the built-in model on http://127.0.0.1:8091
    omni-accel serve --model ./FLUX.1-Kontext-dev --device cuda --attention auto --api-key $KEY
    torchrun --nproc_per_node=2 -m omni_accel serve --model ./FLUX.1-dev --sp 2

In Python: ``model = LoadedModel.from_pipeline(pipe, "my-model"); create_app(model, image_queue(model))`` gives the
ASGI app. Every route runs its work as jobs on one mechanism (serve/jobs.py: ``JobQueue``, ``Job``, ``JobKind``).
Needs the ``serve`` extra (fastapi, uvicorn, python-multipart, prometheus-client); nothing here imports them until
used.
"""

from __future__ import annotations


def __getattr__(name):
    if name in ("create_app",):
        from .app import create_app

        return create_app
    if name in ("image_queue", "ImageRequest", "Limits", "LoadedModel"):
        from . import engine

        return getattr(engine, name)
    if name in ("Job", "JobKind", "JobQueue"):
        from . import jobs

        return getattr(jobs, name)
    if name in ("build_server", "add_arguments", "run"):
        from . import server

        return getattr(server, name)
    raise AttributeError(name)
