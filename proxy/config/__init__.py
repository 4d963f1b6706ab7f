"""config.yaml: the one schema (`schema`, its types in `types`), the rules across keys (`rules`),
the loader (`load`), the typed settings made from the schema (`settings`), serve's options
(`serving`) and the operators' own middleware sections (`custom`)."""
