"""Reading the store for people: tables, exports, plots and the HTML report."""
