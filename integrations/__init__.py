"""kreg inside other frameworks: `import kreg.integrations.transformers` adds `attn_implementation="kreg"`
to Hugging Face transformers. Each module imports its framework, an optional extra of kreg's."""
