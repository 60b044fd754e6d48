from flowkit.cli.executor import executor

executor()
