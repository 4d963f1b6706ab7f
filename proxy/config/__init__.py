"""config.yaml: the one schema (`schema`, its types in `types`) and the loader (`load`)."""
