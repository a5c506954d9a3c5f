from experiments import schema  # noqa: F401  (registers the commands' schemas, conf/<command>.yaml's)
