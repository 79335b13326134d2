"""``pagoda router``: an OpenAI-compatible streaming proxy in front of every ModelDeployment it may see.

It routes each request by its ``model`` (a served model name or a LoRA adapter name) to one of that model's ready
pods, chosen for prefix affinity (the pods' KV caches) weighed against their load, streams the reply through, holds
requests for a model with no ready pod (stamping demand for the operator's autoscaler) and retries on another pod
when one fails before answering. Server modules (``cli``, ``app``, ``proxy``, ``hold``, ``discovery``,
``static_models``, ``metrics``) sit over the routing core (``prefix``, ``endpoints``, ``picker``, ``load``,
``kv_index``, ``kv_subscriber``), which imports nothing of the server. Run it with ``python -m pagoda_operator.router``
or ``pagoda-router`` (``--help`` lists the flags).
"""
