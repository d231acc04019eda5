"""The fused verify step (acceptance + commit in one executable) and the summary the host fetches."""
