"""Results and reports: the result files (results/<suite>.yaml), their statistics (paired intervals,
ranks), the generated pages and their Markdown."""
