"""serve_bench: the benchmark client, flood, chaos scenarios, cluster simulation and poll-cost
measurement (``serve-app bench | flood | chaos | simulate``, ``python -m serve_bench.poll_cost``).

It lives outside the serving package (``bench/serve_bench/``, installed beside ``serve_app`` by
``pip install -e .``): the engines' deployment version hashes only the code an engine replica
runs (:func:`serve_app.app.deployment_versions`), so editing a benchmark rolls no engine. The
serving code never imports it.
"""
