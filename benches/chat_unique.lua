-- wrk script: like shared/tools/peers/chat.lua (a ~800-char system prompt shared by every request),
-- but every user message is new (it carries a request counter), so nothing past the system
-- prompt was seen before: the case where the gateway's segment cache cannot help the question.
local sys = string.rep("You are a helpful assistant. Answer concisely and accurately. ", 13)
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local n = 0
request = function()
  n = n + 1
  local user = "Question " .. n .. ": " .. string.rep("tell me about topic " .. n .. ". ", 8)
  local body = '{"model":"mock-model","max_tokens":16,"messages":[{"role":"system","content":"' .. sys .. '"},{"role":"user","content":"' .. user .. '"}]}'
  return wrk.format(nil, "/v1/chat/completions", nil, body)
end
