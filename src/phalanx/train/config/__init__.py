"""TrainingArguments: the fields, their checks, and reading them from
the command line, JSON or YAML."""
