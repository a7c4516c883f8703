"""``omni-accel demo``: a Gradio app to try accelerations on a pipeline and compare against the plain one.

    omni-accel demo                      # the built-in model on http://127.0.0.1:7860
    omni-accel demo --model ./FLUX.1-dev --device cuda --port 7861

``omni_accel.demo.app.DemoBackend`` holds the logic (testable without a browser); ``build_demo`` the UI.
Needs the ``demo`` extra (gradio), imported only when the demo runs.
"""
