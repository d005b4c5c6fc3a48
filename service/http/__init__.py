"""Everything that speaks HTTP: routes, request hooks, the data plane every protocol shares, the body guard,
the OpenAPI document and the standard protocols. Only this package and ``service.app`` import Flask or
werkzeug; the engine, the pipeline and balancing never import it."""
