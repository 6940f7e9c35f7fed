# Sourced by benches/callgrind.sh and benches/overhead.sh (TRACING=1): an OTLP sink that costs the
# measured gateway nothing, its own nginx answering 200 to every POST.
# start_otlp_sink DIR PORT: runs it under DIR (config, pid, temp files), appends its pid to PIDS
# (the caller's cleanup kills it by pid) and waits for PORT (the caller's `wait_port`).
start_otlp_sink() {
  local dir=$1 port=$2
  command -v nginx >/dev/null || { echo "nginx not found (TRACING=1 needs it for the OTLP sink)" >&2; exit 1; }
  mkdir -p "$dir/tmp"
  cat > "$dir/nginx.conf" <<NG
worker_processes 1;
pid nginx.pid;
error_log error.log warn;
daemon off;
events { worker_connections 256; }
http {
  access_log off;
  client_body_temp_path tmp; proxy_temp_path tmp; fastcgi_temp_path tmp; uwsgi_temp_path tmp; scgi_temp_path tmp;
  client_max_body_size 64m;
  server { listen 127.0.0.1:$port; location / { return 200; } }
}
NG
  nginx -p "$dir" -c "$dir/nginx.conf" & PIDS+=($!)
  wait_port "$port"
}
