from executors.serve import executor

executor()
