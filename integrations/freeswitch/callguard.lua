-- callguard check per call in FreeSWITCH (mod_lua + mod_curl).
-- UNTESTED here: no FreeSWITCH package on the machines callguard is tested
-- on. The Kamailio config beside it is tested end to end with SIPp.
--
-- Dialplan: <action application="lua" data="callguard.lua"/> before bridge.
-- `callguard serve` answers the decision record as one line of JSON.

local url = "http://127.0.0.1:8080/v1/check"
local api = freeswitch.API()

local function esc(s)
  return (tostring(s or ""):gsub("[^%w%-%._~]", function(c)
    return string.format("%%%02X", string.byte(c))
  end))
end

local call_id = session:getVariable("sip_call_id")
local caller = session:getVariable("caller_id_number")
local callee = session:getVariable("destination_number")
local query = url .. "?call_id=" .. esc(call_id) .. "&caller=" .. esc(caller) .. "&callee=" .. esc(callee)
-- mod_curl: "curl <url> [json] [get]"; a short timeout so a slow check never
-- holds the call (fail open when there is no answer); callguard answers
-- within its --answer-deadline-ms (default 800 ms), below this 1 s.
local record = api:execute("curl", query .. " connect-timeout 1 timeout 1") or ""

if string.find(record, '"decision":"reject"', 1, true) then
  local ms = tonumber(string.match(record, '"retry_after_ms":(%d+)'))
  if ms then
    session:setVariable("sip_rh_Retry-After", tostring(math.ceil(ms / 1000)))
  end
  freeswitch.consoleLog("info", "callguard rejected " .. caller .. ": " .. record .. "\n")
  session:hangup("CALL_REJECTED") -- SIP 603 Decline
end
