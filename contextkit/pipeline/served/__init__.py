"""The pipeline on a served model (a vLLM or other OpenAI-compatible server).

``model``: the model a server serves, rendered as the server renders it
(:class:`~contextkit.pipeline.served.model.ServedModel`); ``requests``: the pipeline's
served side, which lays a chat request out as the engine would, labels its token
ranges for contextkit's vLLM connector and records the usage the server reports;
``wire``: the one definition of the fields the connector reads from
``kv_transfer_params``. Torch-free: the connector imports the wire format from here.
"""
